"""``trainstate inspect``: a generation's components described from its metadata (no tensor data read).

Pure rendering over ``state.json`` (the codec's tagged JSON) and the tensor
files' headers. A tensor referenced under several names (tied weights: the
codec stores it once) is shown once in full and then as the same tensor, in
both the text and the ``--json`` form (``shared_with``). Nested values
(tuples, lists, maps, NumPy scalars, non-finite floats) are rendered one
element per line, never as raw tagged JSON cut off at a width.
"""

from __future__ import annotations

import json
from typing import Any

_INLINE = 100  # a scalar list, or any short JSON, stays on one line up to this width


def references(node: Any, path: str = "", out: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Every tensor reference (``$t``/``$nd``) in ``node`` -> the key paths that hold it, in order."""
    out = {} if out is None else out
    if type(node) is dict:
        if len(node) == 1 and ("$t" in node or "$nd" in node) and type(next(iter(node.values()))) is str:
            out.setdefault(next(iter(node.values())), []).append(path)
            return out
        if len(node) == 1 and type(node.get("$map")) is list:
            for pair in node["$map"]:
                if type(pair) is list and len(pair) == 2:
                    references(pair[1], _child(path, _key_text(pair[0])), out)
            return out
        if len(node) == 1 and type(node.get("$tuple")) is list:
            for i, value in enumerate(node["$tuple"]):
                references(value, f"{path}[{i}]", out)
            return out
        if len(node) == 1 and type(node.get("$odict")) is dict:
            return references(node["$odict"], path, out)
        for key, value in node.items():
            references(value, _child(path, key), out)
    elif type(node) is list:
        for i, value in enumerate(node):
            references(value, f"{path}[{i}]", out)
    return out


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _key_text(key: Any) -> str:
    return key if type(key) is str else json.dumps(key)


def tree(node: Any, layouts: dict[str, dict[str, Any]], shared: dict[str, list[str]], path: str = "") -> Any:
    """The ``--json`` form: tensor references replaced by their dtype, shape and size (and ``shared_with``:
    the other key paths holding the same tensor), tags unwrapped."""
    if type(node) is list:
        return [tree(v, layouts, shared, f"{path}[{i}]") for i, v in enumerate(node)]
    if type(node) is not dict:
        return node
    if len(node) == 1 and ("$t" in node or "$nd" in node):
        ref = next(iter(node.values()))
        entry = layouts.get(ref) if type(ref) is str else None
        if entry is None:
            return {"tensor": ref, "error": "not found in any tensor file"}
        out = {"tensor": ref, "dtype": entry["dtype"], "shape": entry["shape"], "bytes": entry["bytes"]}
        others = [p for p in shared.get(ref, ()) if p != path]
        if others:
            out["shared_with"] = others
        return out
    if len(node) == 1 and type(node.get("$map")) is list:
        return {_key_text(pair[0]): tree(pair[1], layouts, shared, _child(path, _key_text(pair[0])))
                for pair in node["$map"] if type(pair) is list and len(pair) == 2}
    if len(node) == 1 and type(node.get("$tuple")) is list:
        return [tree(v, layouts, shared, f"{path}[{i}]") for i, v in enumerate(node["$tuple"])]
    if len(node) == 1 and type(node.get("$odict")) is dict:
        return tree(node["$odict"], layouts, shared, path)
    return {k: tree(v, layouts, shared, _child(path, k)) for k, v in node.items()}


def scalar(node: Any) -> str | None:
    """A tagged scalar (or a plain JSON one) as text; ``None`` for a container or a tensor."""
    if node is None or type(node) in (bool, int, float, str):
        return json.dumps(node)
    if type(node) is dict and len(node) == 1:
        tag, value = next(iter(node.items()))
        if tag == "$int":
            return str(value)
        if tag == "$float":
            return str(value)
        if tag == "$np" and type(value) is list and len(value) == 2:
            return f"numpy {value[0]} {scalar(value[1])}"
        if tag == "$dtype":
            return f"torch.{value}"
        if tag == "$device":
            return f"device({value!r})"
        if tag == "$bytes" and type(value) is str:
            return f"<{len(value) * 3 // 4} bytes>"
    return None


def _tensor_text(node: Any, layouts: dict[str, dict[str, Any]], shared: dict[str, list[str]], path: str) -> str | None:
    if not (type(node) is dict and len(node) == 1 and ("$t" in node or "$nd" in node)):
        return None
    ref = next(iter(node.values()))
    entry = layouts.get(ref) if type(ref) is str else None
    kind = "" if "$t" in node else "ndarray "
    if entry is None:
        return f"{kind}tensor {ref!r}: not found in any tensor file"
    text = f"{kind}{entry['dtype']} {entry['shape']} ({entry['bytes']:,} B)"
    holders = shared.get(ref, [])
    if len(holders) > 1:
        if holders[0] == path:
            text += f"; tied: also held as {', '.join(holders[1:])} (stored once)"
        else:
            text = f"the same tensor as {holders[0]} (tied; stored once): {text}"
    return text


def render(node: Any, layouts: dict[str, dict[str, Any]], shared: dict[str, list[str]], indent: str,
           path: str = "") -> list[str]:
    """``node``'s children, one per line (containers indented below their key)."""
    if type(node) is dict and len(node) == 1 and type(node.get("$odict")) is dict:
        node = node["$odict"]
    if type(node) is dict and len(node) == 1 and type(node.get("$map")) is list:
        items = [(_key_text(p[0]), p[1]) for p in node["$map"] if type(p) is list and len(p) == 2]
    elif type(node) is dict and len(node) == 1 and type(node.get("$tuple")) is list:
        items = [(f"[{i}]", v) for i, v in enumerate(node["$tuple"])]
    elif type(node) is dict:
        items = list(node.items())
    elif type(node) is list:
        items = [(f"[{i}]", v) for i, v in enumerate(node)]
    else:
        return [f"{indent}{scalar(node) or json.dumps(node)}"]
    lines = []
    for key, value in items:
        child = f"{path}{key}" if key.startswith("[") else _child(path, key)
        lines += _entry(key, value, layouts, shared, indent, child)
    return lines


def _entry(key: str, value: Any, layouts: dict[str, dict[str, Any]], shared: dict[str, list[str]], indent: str,
           path: str) -> list[str]:
    tensor = _tensor_text(value, layouts, shared, path)
    if tensor is not None:
        return [f"{indent}{key}: {tensor}"]
    text = scalar(value)
    if text is not None:
        return [f"{indent}{key}: {text}"]
    elements = value.get("$tuple") if type(value) is dict and len(value) == 1 else value
    if type(elements) is list:
        kind = "tuple" if elements is not value else "list"
        texts = [scalar(v) for v in elements]
        if all(t is not None for t in texts):  # scalars only: one line, or a count and the first ones
            inline = "[" + ", ".join(texts) + "]" if kind == "list" else "(" + ", ".join(texts) + ")"
            if len(inline) <= _INLINE:
                return [f"{indent}{key}: {inline}"]
            shown = ", ".join(texts[:8])
            return [f"{indent}{key}: {kind} of {len(texts)}: {shown}, ... ({len(texts) - 8} more)"]
        return [f"{indent}{key}: {kind} of {len(elements)}"] + render(value, layouts, shared, indent + "  ", path)
    if type(value) is dict and not value:
        return [f"{indent}{key}: {{}}"]
    return [f"{indent}{key}:"] + render(value, layouts, shared, indent + "  ", path)


def architecture_lines(key: str, value: Any, indent: str) -> list[str] | None:
    """A module's architecture record in a line or two: how many tensors, and which are tied to which."""
    if not key.startswith("architecture.") or type(value) is not list:
        return None
    ties = [f"{e[0]} -> {e[3]}" for e in value if type(e) is list and len(e) == 4 and e[3]]
    text = f"{indent}{key}: {len(value)} parameters and buffers"
    return [text + (f"; tied: {', '.join(ties)}" if ties else "; no ties")]


def contract_lines(fields: dict[str, Any], indent: str = "  ") -> list[str]:
    lines = []
    for key, value in fields.items():
        special = architecture_lines(key, value, indent)
        if special is not None:
            lines += special
            continue
        text = json.dumps(value)
        if len(text) <= _INLINE:
            lines.append(f"{indent}{key}: {text}")
        else:
            lines += _entry(key, value, {}, {}, indent, key)
    return lines


def compute_line(compute: dict[str, Any]) -> str:
    """The training compute a manifest records (its optional ``compute`` field): device kinds and wall time."""
    devices = ", ".join(compute.get("devices", ())) or "not recorded"
    wall = compute.get("wall_s")
    wall_text = "not recorded" if wall is None else f"{wall:.3f} s summed over the lineage's updates"
    return f"compute: device {devices}; wall time {wall_text}"
