"""Pure encoding: bytes in, values out. Nothing in this layer opens a file or touches a directory.

- ``codec``: the tagged JSON for every non-tensor value (never pickle).
- ``tensorfile``: the safetensors layout of a generation's tensors.
- ``manifest``: manifest, pointer and pins records.
- ``names``: generation names, parsed and ordered.
- ``sharing``: what an incremental manifest says of its shared files and spare copies.
- ``strictjson``: the strict, memory-bounded JSON parser every metadata file is read with.
- ``digest``: content digests (BLAKE3, SHA-256).
- ``signing``: the optional HMAC-SHA256 signature of manifests and pointers.
"""
