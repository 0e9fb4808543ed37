"""Checkpoint tree <-> typed JSON tree + named tensors (pure encoding, no files).

A Lightning checkpoint is a tree of dicts, lists and leaves. ``encode`` turns it into a JSON-able
tree in which every leaf carries its type, and a flat ``{name: tensor}`` mapping for the tensors
(named by their key path, shared tensors stored once). ``decode`` is the exact inverse, type for
type. Nothing here imports code by name from the file: enums and converters are resolved only from
classes already imported (``sys.modules``) or registered with :func:`register_converter`, so a
hostile header can describe nothing that runs code. This module must not touch files or Lightning
loops.

Node schema (``"@"`` is the type tag; str, int, bool, None, finite float and list are plain JSON):
``{"@": "dict", "v": {...}}`` (str keys) or ``{"@": "dict", "i": [[k, v], ...]}`` (any keys), and
the same for ``odict``/``attrdict``/``namespace``; ``tuple``, ``set``, ``frozenset``, ``size``
carry ``"v": [...]``; ``float`` (non-finite) carries its 8 IEEE bytes in hex; ``tensor``/``ndarray``
carry ``"k"``, the tensor's name (never a name safetensors reserves, such as ``__metadata__``); ``enum``
carries ``"cls"`` and the member's ``"name"``, or for a ``Flag`` combination its integer ``"value"``; the
rest are listed in ``_ENCODERS``. A value that would not load back as itself fails at encode time.
"""

from __future__ import annotations

import argparse
import base64
import collections
import datetime as dt
import enum
import json
import math
import pathlib
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from lightning_resume.errors import TreeFormatError, UnencodableValueError, UnknownTypeError, short_repr
from lightning_resume.io.framing import check_storable, unique_keys

MAX_DEPTH = 512
"""Deepest nesting accepted on decode (and in a legacy file's tree): a hostile file cannot exhaust the
stack. Raise it by assigning ``lightning_resume.io.codec.MAX_DEPTH`` before loading."""
MAX_TREE_NODES = 2_000_000
"""Most nodes (containers, keys and leaves) a checkpoint tree may have, in a typed JSON header or a legacy
file (where a container reached twice counts twice): bounds the memory and time of decoding and of every
later walk. A real Lightning checkpoint has a few per tensor. Raise it by assigning
``lightning_resume.io.codec.MAX_TREE_NODES`` before loading."""
MAX_HASH_COLLISIONS = 64
"""Most keys of one decoded dict or set that may share a hash value. Integers that differ by multiples of
2**61 - 1 all hash alike, and building a dict of n of them takes n**2 steps (hash flooding); real keys
almost never share a hash. Raise it by assigning ``lightning_resume.io.codec.MAX_HASH_COLLISIONS``."""

RESERVED_TENSOR_NAMES = frozenset({"__metadata__"})
"""Names safetensors keeps for itself: a tensor at such a key path is stored under another name."""


@dataclass(frozen=True)
class Converter:
    cls: type
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    name: str


_CONVERTERS_BY_TYPE: Dict[type, Converter] = {}
_CONVERTERS_BY_NAME: Dict[str, Converter] = {}


def register_converter(cls: type, encode: Callable[[Any], Any], decode: Callable[[Any], Any], name: str = "") -> None:
    """Teach the format a type: ``encode(obj)`` returns something encodable, ``decode`` inverts it.

    ``name`` (default ``module:QualName``) is what the file records; registration, not the file,
    decides which code runs on load.
    """
    conv = Converter(cls, encode, decode, name or _qualified_name(cls))
    _CONVERTERS_BY_TYPE[cls] = conv
    _CONVERTERS_BY_NAME[conv.name] = conv


@dataclass
class Encoded:
    """Result of :func:`encode`: the JSON-able tree and the tensors it refers to by name."""

    tree: Any
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- encode


def encode(tree: Any) -> Encoded:
    """Encode a checkpoint tree; raises ``UnencodableValueError`` naming the first bad key path."""
    return _Encoder().run(tree)


class _Encoder:
    def __init__(self) -> None:
        self.out = Encoded(tree=None)
        self.seen: Dict[Tuple, str] = {}
        self.stack: set = set()

    def run(self, tree: Any) -> Encoded:
        self.deepest = ""
        try:
            self.out.tree = self.node(tree, "")
        except RecursionError as err:  # caught here, with the stack unwound, so building the error cannot recurse
            raise UnencodableValueError(
                self.deepest or "<root>", "container", "nested deeper than Python's recursion limit allows to encode"
            ) from err
        return self.out

    def node(self, x: Any, path: str) -> Any:
        t = type(x)
        if t is int and x.bit_length() > 64:
            _check_int_digits(x, path)
        if x is None or t in (str, bool, int):
            return x
        if t is float:
            return x if math.isfinite(x) else {"@": "float", "v": struct.pack("<d", x).hex()}
        if t is list:
            return self.container(x, path, lambda: [self.node(v, _join(path, i)) for i, v in enumerate(x)])
        if isinstance(x, torch.Tensor):
            return self.tensor(x, path)
        if t in _CONVERTERS_BY_TYPE:
            conv = _CONVERTERS_BY_TYPE[t]
            return {"@": "custom", "name": conv.name, "v": self.node(conv.encode(x), path)}
        if isinstance(x, enum.Enum):
            return _encode_enum(x, path)
        if t in _MAPPINGS:
            return self.container(x, path, lambda: self.mapping(_MAPPINGS[t], _mapping_items(x), path))
        if t in _SEQUENCES:
            items = sorted(x, key=repr) if t in (set, frozenset) else x
            return self.container(
                x, path, lambda: {"@": _SEQUENCES[t], "v": [self.node(v, _join(path, i)) for i, v in enumerate(items)]}
            )
        if isinstance(x, np.ndarray) and t is np.ndarray:
            return {"@": "ndarray", "k": self.add_tensor(_numpy_to_tensor(x, path), path, x)}
        for cls, enc in _ENCODERS:
            if t is cls:
                return enc(x)
        if isinstance(x, np.generic):
            return _encode_npscalar(x, path)
        raise UnencodableValueError(path or "<root>", _qualified_name(t))

    def container(self, x: Any, path: str, build: Callable[[], Any]) -> Any:
        if id(x) in self.stack:
            raise UnencodableValueError(path, _qualified_name(type(x)), "it contains itself (a reference cycle)")
        if len(self.stack) >= MAX_DEPTH:  # the reader refuses deeper trees: fail the save, not the resume
            raise UnencodableValueError(path, _qualified_name(type(x)), f"nested deeper than MAX_DEPTH={MAX_DEPTH}")
        self.deepest = path
        self.stack.add(id(x))
        try:
            return build()
        finally:
            self.stack.discard(id(x))

    def mapping(self, tag: str, items: List[Tuple[Any, Any]], path: str) -> Dict[str, Any]:
        if all(type(k) is str for k, _ in items):
            return {"@": tag, "v": {k: self.node(v, _join(path, k)) for k, v in items}}
        return {
            "@": tag,
            "i": [[self.node(k, _join(path, f"<key {k!r}>")), self.node(v, _join(path, k))] for k, v in items],
        }

    def tensor(self, t: torch.Tensor, path: str) -> Dict[str, Any]:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnencodableValueError(path, _qualified_name(type(t)), "tensor subclasses are not supported")
        node: Dict[str, Any] = {"@": "tensor", "k": self.add_tensor(t, path, t)}
        if type(t) is torch.nn.Parameter:
            node["param"] = True
        if t.requires_grad:
            node["grad"] = True
        return node

    def add_tensor(self, t: torch.Tensor, path: str, owner: Any) -> str:
        check_storable(t, path)
        key = _alias_key(t)
        if key is not None and key in self.seen:
            return self.seen[key]
        name = path or "<root>"
        while name in self.out.tensors or name in RESERVED_TENSOR_NAMES:
            name += "#"
        self.out.tensors[name] = t.detach()
        if key is not None:
            self.seen[key] = name
        return name


def _check_int_digits(x: int, path: str) -> None:
    """An int JSON cannot write or read back (Python limits int<->str conversion to
    ``sys.get_int_max_str_digits()`` digits) fails the save here, naming its key path."""
    try:
        str(x)
    except ValueError as err:
        raise UnencodableValueError(
            path or "<root>", "int", f"{x.bit_length()} bits: more decimal digits than Python converts to text"
        ) from err


def _alias_key(t: torch.Tensor) -> Optional[Tuple]:
    """Identity of the exact bytes a tensor shows: equal keys are stored once and load as one tensor."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _encode_enum(x: enum.Enum, path: str) -> Dict[str, Any]:
    """An enum member by class and name, or a ``Flag`` combination (``re.I | re.M``, ``Perm(0)``) by
    value; only if the loader will find the very same member, else the save fails here."""
    cls = type(x)
    qualified = _qualified_name(cls)
    if "<locals>" in cls.__qualname__ or _resolve_loaded_class(qualified) is not cls:
        raise UnencodableValueError(
            path or "<root>",
            qualified,
            "its enum class cannot be found by name when loading (defined inside a function, or not "
            "reachable as module.ClassName); define it at module level or register a converter",
        )
    if x.name is not None and cls.__members__.get(x.name) is x:
        return {"@": "enum", "cls": qualified, "name": x.name}
    if isinstance(x, enum.Flag) and type(x.value) is int and _flag_from_value(cls, x.value) is x:
        return {"@": "enum", "cls": qualified, "value": x.value}
    raise UnencodableValueError(path or "<root>", qualified, f"enum member {x!r} is not reachable by name or value")


def _flag_from_value(cls: Any, value: int) -> Any:
    try:
        return cls(value)
    except (ValueError, TypeError):
        return None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _mapping_items(x: Any) -> List[Tuple[Any, Any]]:
    return list(vars(x).items()) if isinstance(x, argparse.Namespace) else list(x.items())


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _numpy_to_tensor(x: np.ndarray, path: str) -> torch.Tensor:
    if x.dtype.kind not in "biufc" or not x.dtype.isnative:
        raise UnencodableValueError(path, f"numpy.ndarray[{x.dtype}]", "only native numeric arrays are stored")
    return torch.from_numpy(np.ascontiguousarray(x))


def _encode_npscalar(x: np.generic, path: str) -> Dict[str, Any]:
    if x.dtype.kind not in "biufc":
        raise UnencodableValueError(path, _qualified_name(type(x)))
    return {"@": "npscalar", "dtype": x.dtype.str, "v": x.tobytes().hex()}


def _attr_dict_type() -> type:
    from lightning.fabric.utilities.data import AttributeDict

    return AttributeDict


_MAPPINGS: Dict[type, str] = {
    dict: "dict",
    OrderedDict: "odict",
    _attr_dict_type(): "attrdict",
    argparse.Namespace: "namespace",
}
_SEQUENCES: Dict[type, str] = {tuple: "tuple", set: "set", frozenset: "frozenset", torch.Size: "size"}
_PATH_TYPES = {
    c.__name__: c for c in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)
}
_ENCODERS: List[Tuple[type, Callable[[Any], Any]]] = [
    (bytes, lambda x: {"@": "bytes", "v": base64.b64encode(x).decode("ascii")}),
    (bytearray, lambda x: {"@": "bytearray", "v": base64.b64encode(bytes(x)).decode("ascii")}),
    (complex, lambda x: {"@": "complex", "v": [struct.pack("<d", x.real).hex(), struct.pack("<d", x.imag).hex()]}),
    (torch.dtype, lambda x: {"@": "dtype", "v": str(x).replace("torch.", "")}),
    (torch.device, lambda x: {"@": "device", "v": str(x)}),
    (dt.datetime, lambda x: {"@": "datetime", "v": x.isoformat()}),
    (dt.date, lambda x: {"@": "date", "v": x.isoformat()}),
    (dt.time, lambda x: {"@": "time", "v": x.isoformat()}),
    (dt.timedelta, lambda x: {"@": "timedelta", "v": [x.days, x.seconds, x.microseconds]}),
] + [(cls, lambda x: {"@": "path", "cls": type(x).__name__, "v": str(x)}) for cls in _PATH_TYPES.values()]


# ----------------------------------------------------------------------------------------- decode


def parse_tree(tree_json: str) -> Any:
    """The JSON text of a tree, parsed only if it has at most ``MAX_TREE_NODES`` values.

    Counted before parsing, from the characters that start or separate JSON values (an upper bound:
    the same characters inside strings count too), so a hostile header never gets to build its
    containers: each costs about 60 bytes of memory for 3 bytes of JSON, twice (parsed, decoded).
    """
    estimate = 1 + sum(tree_json.count(c) for c in "[{,:")
    if estimate > MAX_TREE_NODES:
        raise TreeFormatError(
            f"tree has more than MAX_TREE_NODES={MAX_TREE_NODES} values (about {estimate}); raise "
            "lightning_resume.io.codec.MAX_TREE_NODES to read it"
        )
    return json.loads(tree_json, object_pairs_hook=unique_keys)


def decode(tree: Any, tensors: Mapping[str, torch.Tensor], lenient: bool = False) -> Any:
    """Inverse of :func:`encode`. ``tensors`` maps names to loaded tensors.

    Raises ``TreeFormatError`` for a malformed tree and ``UnknownTypeError`` for an enum class or
    converter this process does not know; with ``lenient=True`` (inspection tools) those decode to
    their recorded plain value instead.
    """
    return _Decoder(tensors, lenient).node(tree, 0)


class _Decoder:
    def __init__(self, tensors: Mapping[str, torch.Tensor], lenient: bool) -> None:
        self.tensors = tensors
        self.lenient = lenient

    def node(self, x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TreeFormatError(f"tree nested deeper than {MAX_DEPTH}")
        if x is None or type(x) in (str, bool, int, float):
            return x
        if type(x) is list:
            return [self.node(v, depth + 1) for v in x]
        if type(x) is not dict or type(x.get("@")) is not str:
            raise TreeFormatError(f"unexpected node {short_repr(x)}")
        try:
            return self.tagged(x["@"], x, depth + 1)
        except (
            KeyError,
            TypeError,
            ValueError,
            IndexError,
            AttributeError,
            OverflowError,
            RuntimeError,
            struct.error,
        ) as err:
            # RuntimeError: torch refusing a value the tree asks for (a bogus device, grad on integers)
            if isinstance(err, TreeFormatError):
                raise
            raise TreeFormatError(f"malformed {x['@']!r} node {short_repr(x)}: {err}") from err

    def tagged(self, tag: str, x: Dict[str, Any], depth: int) -> Any:
        if tag in _MAPPING_TAGS:
            return self.mapping(tag, x, depth)
        if tag in _SEQUENCE_TAGS:
            return _SEQUENCE_TAGS[tag](self.node(v, depth) for v in _as_list(x["v"]))
        if tag in ("tensor", "ndarray"):
            return self.tensor(tag, x)
        if tag == "enum":
            return self.enum(x)
        if tag == "custom":
            return self.custom(x, depth)
        if tag in _LEAF_DECODERS:
            return _LEAF_DECODERS[tag](x)
        raise TreeFormatError(f"unknown node type {tag!r}")

    def mapping(self, tag: str, x: Dict[str, Any], depth: int) -> Any:
        if "v" in x:
            if type(x["v"]) is not dict:
                raise TreeFormatError(f"{tag} node without an object of values")
            items = [(k, self.node(v, depth)) for k, v in x["v"].items()]
        else:
            items = [
                (_hashable(self.node(k, depth)), self.node(v, depth)) for k, v in (_pair(p) for p in _as_list(x["i"]))
            ]
            _check_hash_spread(tag, [k for k, _ in items])
        if tag == "namespace":
            return argparse.Namespace(**{str(k): v for k, v in items})
        return _MAPPING_TAGS[tag]()(items)

    def tensor(self, tag: str, x: Dict[str, Any]) -> Any:
        name = x["k"]
        if type(name) is not str or name not in self.tensors:
            raise TreeFormatError(f"tree refers to tensor {name!r} which the file does not hold")
        t = self.tensors[name]
        if tag == "ndarray":
            return t.numpy()
        grad = bool(x.get("grad")) and (t.is_floating_point() or t.is_complex())  # only these can require grad
        if x.get("param"):
            return torch.nn.Parameter(t, requires_grad=grad)
        return t.requires_grad_(True) if grad else t

    def enum(self, x: Dict[str, Any]) -> Any:
        cls = _resolve_loaded_class(x["cls"])
        member = f"{x['cls']}.{x['name']}" if "name" in x else f"{x['cls']}({_int(x['value'])})"
        if cls is None or not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            if self.lenient:
                return member
            raise UnknownTypeError(
                f"checkpoint holds an enum member {member} but that class is not imported in this "
                "process; import its module before loading (lightning-resume never imports modules named by a file)"
            )
        if "name" in x:
            return cls[_str(x["name"])]
        if not issubclass(cls, enum.Flag):
            raise TreeFormatError(f"enum member {member} by value, but {x['cls']} is not a Flag")
        return cls(_int(x["value"]))

    def custom(self, x: Dict[str, Any], depth: int) -> Any:
        conv = _CONVERTERS_BY_NAME.get(x["name"])
        value = self.node(x["v"], depth)
        if conv is not None:
            return conv.decode(value)
        if self.lenient:
            return value
        raise UnknownTypeError(
            f"checkpoint holds a value written by converter {x['name']!r}, which is not registered here; "
            "call lightning_resume.register_converter(...) before loading"
        )


def _resolve_loaded_class(qualified: Any) -> Any:
    """Find ``module:Qual.Name`` among modules already imported; never imports anything."""
    if type(qualified) is not str or ":" not in qualified:
        raise TreeFormatError(f"bad class name {qualified!r}")
    module_name, qualname = qualified.split(":", 1)
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        if obj is None or part.startswith("__"):
            return None
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    return obj


def _as_list(x: Any) -> list:
    if type(x) is not list:
        raise TreeFormatError(f"expected a list, found {short_repr(x)}")
    return x


def _pair(p: Any) -> Tuple[Any, Any]:
    if type(p) is not list or len(p) != 2:
        raise TreeFormatError(f"expected a [key, value] pair, found {short_repr(p)}")
    return p[0], p[1]


def _hashable(k: Any) -> Any:
    try:
        hash(k)
    except TypeError as err:
        raise TreeFormatError(f"dict key {short_repr(k)} is not hashable") from err
    return k


def _check_hash_spread(what: str, keys: List[Any]) -> None:
    """Refuse keys that would make building the dict or set quadratic (many equal hashes).

    Counting hash values is linear: the counter's own keys are those hashes, and an int below
    2**61 - 1 hashes to itself, so they cannot collide again."""
    if len(keys) <= MAX_HASH_COLLISIONS:
        return
    value, count = collections.Counter(map(hash, keys)).most_common(1)[0]
    if count > MAX_HASH_COLLISIONS:
        raise TreeFormatError(
            f"{what} has {count} keys with the same hash {value} (hash flooding?); at most "
            f"MAX_HASH_COLLISIONS={MAX_HASH_COLLISIONS} (raise lightning_resume.io.codec.MAX_HASH_COLLISIONS)"
        )


def _hashed(what: str, values: Any, build: Callable[[Any], Any]) -> Any:
    items = [_hashable(v) for v in values]
    _check_hash_spread(what, items)
    return build(items)


def _float_from_hex(h: Any) -> float:
    if type(h) is not str or len(h) != 16:
        raise TreeFormatError(f"bad float bytes {short_repr(h)}")
    return struct.unpack("<d", bytes.fromhex(h))[0]


_DTYPES_BY_NAME: Dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}
"""Every dtype by its name in ``torch``, read once from the module's own dict: a name in a file is looked up
here, never with ``getattr(torch, name)`` (which runs torch's module ``__getattr__`` for names such as
``has_cuda``)."""


def _dtype_from_name(name: Any) -> torch.dtype:
    value = _DTYPES_BY_NAME.get(name) if type(name) is str else None
    if value is None:
        raise TreeFormatError(f"unknown torch dtype {short_repr(name)}")
    return value


def _size(values: Any) -> torch.Size:
    """A ``torch.Size`` of dimensions torch can hold (0 <= d < 2**63): a larger one builds an object whose
    ``repr`` raises."""
    dims = [_int(v) for v in values]
    if not all(0 <= d < 2**63 for d in dims):
        raise TreeFormatError(f"torch.Size dimension out of range 0..2**63-1: {short_repr(dims)}")
    return torch.Size(dims)


def _path_from(x: Dict[str, Any]) -> pathlib.PurePath:
    cls = _PATH_TYPES[x["cls"]]
    if cls is pathlib.WindowsPath and sys.platform != "win32":
        cls = pathlib.PureWindowsPath
    if cls is pathlib.PosixPath and sys.platform == "win32":
        cls = pathlib.PurePosixPath
    return cls(_str(x["v"]))


def _npscalar(x: Dict[str, Any]) -> np.generic:
    dtype = np.dtype(_str(x["dtype"]))
    if dtype.kind not in "biufc":
        raise TreeFormatError(f"numpy scalar of non-numeric dtype {dtype}")
    raw = bytes.fromhex(_str(x["v"]))
    if len(raw) != dtype.itemsize:
        raise TreeFormatError(f"numpy scalar of {dtype} with {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)[0]


def _str(x: Any) -> str:
    if type(x) is not str:
        raise TreeFormatError(f"expected a string, found {short_repr(x)}")
    return x


def _timedelta(v: Any) -> dt.timedelta:
    days, seconds, micro = _as_list(v)
    if not all(type(n) is int for n in (days, seconds, micro)):
        raise TreeFormatError(f"bad timedelta {short_repr(v)}")
    return dt.timedelta(days=days, seconds=seconds, microseconds=micro)


_MAPPING_TAGS: Dict[str, Callable[[], Callable[[Any], Any]]] = {
    "dict": lambda: dict,
    "odict": lambda: OrderedDict,
    "attrdict": _attr_dict_type,
    "namespace": lambda: dict,
}
_SEQUENCE_TAGS: Dict[str, Callable[[Any], Any]] = {
    "tuple": tuple,
    "set": lambda it: _hashed("set", it, set),
    "frozenset": lambda it: _hashed("frozenset", it, frozenset),
    "size": _size,
}


def _int(v: Any) -> int:
    if type(v) is not int:
        raise TreeFormatError(f"expected an int, found {short_repr(v)}")
    return v


_LEAF_DECODERS: Dict[str, Callable[[Dict[str, Any]], Any]] = {
    "float": lambda x: _float_from_hex(x["v"]),
    "bytes": lambda x: base64.b64decode(_str(x["v"]), validate=True),
    "bytearray": lambda x: bytearray(base64.b64decode(_str(x["v"]), validate=True)),
    "complex": lambda x: complex(*(_float_from_hex(h) for h in _as_list(x["v"]))),
    "dtype": lambda x: _dtype_from_name(x["v"]),
    "device": lambda x: torch.device(_str(x["v"])),
    "datetime": lambda x: dt.datetime.fromisoformat(_str(x["v"])),
    "date": lambda x: dt.date.fromisoformat(_str(x["v"])),
    "time": lambda x: dt.time.fromisoformat(_str(x["v"])),
    "timedelta": lambda x: _timedelta(x["v"]),
    "path": _path_from,
    "npscalar": _npscalar,
}
