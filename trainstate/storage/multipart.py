"""Multipart uploads: the part size, and the uploads a killed process left open on S3 (aborted by a cleanup).

A process SIGKILLed mid-upload leaves its multipart upload open: its parts
are stored (and billed) but no object lists them, and ``obstore`` cannot
list them. Where ``boto3`` is installed, the S3 backend asks for the open
uploads under the run's ``attempts/`` prefix, and the cleanup aborts those of
attempts that no commit record names. Without ``boto3`` (or on GCS and
Azure) nothing is listed; give the bucket a lifecycle rule that aborts
incomplete multipart uploads (``AbortIncompleteMultipartUpload``) instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("trainstate")
PART_SIZE = 16 << 20  # multipart part size: large enough for throughput, small enough to bound memory
MAX_PARTS = 10_000  # S3's (and its imitators') limit on the parts of one multipart upload


def part_size(size_hint: int | None) -> int:
    """The multipart part size for a file of about ``size_hint`` bytes: ``PART_SIZE``, or larger (in whole
    MiB, with a tenth to spare) when the file would otherwise need more than ``MAX_PARTS`` parts."""
    if not size_hint:
        return PART_SIZE
    needed = -(-size_hint * 11 // 10 // MAX_PARTS)  # ceil, 10% headroom for a hint that runs short
    return max(PART_SIZE, -(-needed // (1 << 20)) << 20)



class OpenUploads:
    """The open multipart uploads under one S3 run prefix (nothing where they cannot be listed)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None):
        parts = urlsplit(url)
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        self._client: Any = None
        if parts.scheme != "s3":
            return
        try:
            import boto3
        except ImportError:
            log.debug("boto3 is not installed: open multipart uploads of killed saves are not listed")
            return
        opts = storage_options or {}
        endpoint = opts.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL")
        self._client = boto3.client(
            "s3", endpoint_url=endpoint, region_name=opts.get("region") or os.environ.get("AWS_REGION") or None,
            aws_access_key_id=opts.get("access_key_id"), aws_secret_access_key=opts.get("secret_access_key"),
            aws_session_token=opts.get("token"))

    def _key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def listed(self, relative_prefix: str) -> list[tuple[str, str]]:
        """``(key relative to the run, upload id)`` of every open upload under ``relative_prefix``."""
        if self._client is None:
            return []
        found: list[tuple[str, str]] = []
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._key(relative_prefix))
            for page in pages:
                for upload in page.get("Uploads", []):
                    found.append((upload["Key"][len(self._key("")):], upload["UploadId"]))
        except Exception as exc:  # listing is housekeeping: never the save's failure
            log.warning("could not list open multipart uploads in s3://%s/%s (%s)", self.bucket,
                        self._key(relative_prefix), exc)
        return found

    def abort(self, relative_key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(relative_key), UploadId=upload_id)
        except Exception as exc:
            log.warning("could not abort the open upload of %s (%s); the next cleanup retries", relative_key, exc)
