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

:class:`TreeEncoder` encodes the trees of successive saves and reuses the last encoding while the tree
keeps its signature (the containers above its tensors and the tensors' names, types, dtypes, shapes,
devices and aliasing): then only the tensor-free subtrees (counters, RNG states, hyper-parameters) are
encoded again, and each tensor costs a handful of C-level reads of its metadata instead of a walk through
the encoder.
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
import secrets
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from json.encoder import encode_basestring_ascii
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from lightning_resume.errors import TreeFormatError, UnencodableValueError, UnknownTypeError, short_repr
from lightning_resume.format.framing import check_storable, unique_keys

MAX_DEPTH = 512
"""Deepest nesting accepted on decode (and in a legacy file's tree): a hostile file cannot exhaust the
stack. Raise it by assigning ``lightning_resume.format.codec.MAX_DEPTH`` before loading."""
MAX_TREE_NODES = 2_000_000
"""Most nodes (containers, keys and leaves) a checkpoint tree may have, in a typed JSON header or a legacy
file (where a container reached twice counts twice): bounds the memory and time of decoding and of every
later walk. A real Lightning checkpoint has a few per tensor. Raise it by assigning
``lightning_resume.format.codec.MAX_TREE_NODES`` before loading."""
MAX_HASH_COLLISIONS = 64
"""Most keys of one decoded dict or set that may share a hash value. Integers that differ by multiples of
2**61 - 1 all hash alike, and building a dict of n of them takes n**2 steps (hash flooding); real keys
almost never share a hash. Raise it by assigning ``lightning_resume.format.codec.MAX_HASH_COLLISIONS``."""

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
_registrations = 0
"""Converters registered so far: a reused encoding is stale once a converter could encode its containers otherwise."""


def register_converter(cls: type, encode: Callable[[Any], Any], decode: Callable[[Any], Any], name: str = "") -> None:
    """Teach the format a type: ``encode(obj)`` returns something encodable, ``decode`` inverts it.

    ``name`` (default ``module:QualName``) is what the file records; registration, not the file,
    decides which code runs on load.
    """
    global _registrations
    conv = Converter(cls, encode, decode, name or _qualified_name(cls))
    _CONVERTERS_BY_TYPE[cls] = conv
    _CONVERTERS_BY_NAME[conv.name] = conv
    _registrations += 1


@dataclass
class Encoded:
    """Result of :func:`encode`: the JSON-able tree and the tensors it refers to by name."""

    tree: Any
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- encode


def encode(tree: Any) -> Encoded:
    """Encode a checkpoint tree; raises ``UnencodableValueError`` naming the first bad key path."""
    return _Encoder().run(tree)


def to_json(tree: Any) -> str:
    """The JSON text of an encoded tree, as files hold it (compact, ASCII, no NaN)."""
    return _JSON.encode(tree)


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=True)


class _Encoder:
    def __init__(self, depth_limit: Optional[int] = None) -> None:
        self.out = Encoded(tree=None)
        self.seen: Dict[Tuple, str] = {}
        self.stack: set = set()
        self.depth_limit = MAX_DEPTH if depth_limit is None else depth_limit
        """Containers that may be open at once: ``MAX_DEPTH``, less the depth a subtree is encoded at."""

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
            return self.container(
                x, path, lambda: _plain_items(x) or [self.node(v, _join(path, i)) for i, v in enumerate(x)]
            )
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
                x,
                path,
                lambda: {
                    "@": _SEQUENCES[t],
                    "v": _plain_items(items) or [self.node(v, _join(path, i)) for i, v in enumerate(items)],
                },
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
        if len(self.stack) >= self.depth_limit:  # the reader refuses deeper trees: fail the save, not the resume
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
    """Identity of the exact bytes a tensor shows (where they start, and how they are seen): equal keys are
    stored once and load as one tensor. :class:`TreeEncoder` groups tensors by the same key."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


_SELF_ENCODING = frozenset({str, bool, type(None)})
_INT64 = 1 << 64


def _plain_items(x: Any) -> Optional[List[Any]]:
    """``list(x)`` when every item encodes as itself (strings, bools, ``None``, or only ints of at most 64
    bits), checked in C: a long list of step counts or an RNG state is not walked item by item."""
    types = set(map(type, x))
    if not types or not (types <= _SELF_ENCODING or (types == {int} and min(x) > -_INT64 and max(x) < _INT64)):
        return None
    return list(x)


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


# ----------------------------------------------------------------------------------------- reuse

REUSE_DEPTH = 64
"""Deepest tree whose encoding :class:`TreeEncoder` reuses: a deeper one is encoded in full at every save,
so the checks that depend on depth (``MAX_DEPTH``, Python's recursion limit) apply to it exactly as always."""


@dataclass(frozen=True)
class TreeText:
    """A tree encoded for a file (:meth:`TreeEncoder.encode`): its JSON text and its tensors by name.

    ``layout`` is the same object for two encodings only if their tensors have the same names, dtypes,
    shapes and devices, in the same order (``None`` when nothing is known): whoever lays the tensors out
    (``buffers.HostBuffers``) may then skip comparing them one by one. The tensors are the tree's own, not
    copied; a reused encoding does not detach them either.
    """

    tree_json: str
    tensors: Dict[str, torch.Tensor]
    layout: Optional[object] = None
    pointers: Optional[List[int]] = None
    """The data pointers of ``tensors``' values, in order, as read while encoding (a reused encoding reads
    them anyway, to compare aliasing): whoever copies the tensors need not read them again."""
    plain: bool = False
    """Whether every tensor was found contiguous CPU memory with no conjugate or negative bit (read in the
    same pass over the tensors; ``False`` when not known)."""


class TreeEncoder:
    """Encodes the trees of successive saves, reusing the last encoding while the tree keeps its signature.

    The signature: the containers above the tensors (type, keys and their types, length) and the tensors
    themselves (type, dtype, shape, device, ``requires_grad``, which of them alias). Everything
    else, every tensor-free subtree (step counters, RNG states, hyper-parameters, callback states), is
    encoded again at every save and spliced into the JSON text kept from the last full encoding, which is
    then byte for byte the text :func:`encode` and :func:`to_json` give. A tree that differs anywhere in
    its signature is encoded in full, and its signature kept for the next save. Tensors in a set, a
    namespace, a converter's value or a numpy array are not tracked: such trees are always encoded in full.
    """

    def __init__(self) -> None:
        self._plan: Optional[_Plan] = None
        self.reused = 0
        """Encodings that reused the last one (only the tensor-free subtrees encoded)."""
        self.encoded = 0
        """Encodings in full: the first, and each whose signature had changed."""
        self._unused = 0  # plans in a row dropped without ever being reused

    def encode(self, tree: Any) -> TreeText:
        """Encode ``tree``, reusing the last encoding where it applies (``UnencodableValueError`` naming the
        first bad key path, as :func:`encode`)."""
        reused = self.reuse(tree)
        return reused if reused is not None else self.encode_in_full(tree)

    def reuse(self, tree: Any) -> Optional[TreeText]:
        """The encoding of ``tree`` if it has the kept encoding's signature (only its tensor-free subtrees
        encoded), else ``None``: then :meth:`encode_in_full` it."""
        plan = self._plan
        text = None if plan is None else plan.reuse(tree)
        if plan is not None and text is not None:
            self.reused += 1
            plan.reused, self._unused = True, 0
        return text

    def encode_in_full(self, tree: Any) -> TreeText:
        """Encode ``tree`` as :func:`encode` does, and keep the encoding for the next save."""
        encoded = encode(tree)
        tree_json = to_json(encoded.tree)
        self.encoded += 1
        self._plan = self._next_plan(tree, encoded, tree_json)
        return TreeText(tree_json, encoded.tensors, self._plan)

    def _next_plan(self, tree: Any, encoded: Encoded, tree_json: str) -> Optional[_Plan]:
        """Keep this encoding for the next save, unless signatures change every save: then (after
        ``_GIVE_UP`` plans in a row were never reused) try again only every ``_RETRY``-th full encoding."""
        if self._plan is not None and not self._plan.reused:
            self._unused += 1
        if self._unused >= _GIVE_UP and self.encoded % _RETRY:
            return None
        try:
            plan = _Plan(encoded, tree_json)
        except _Unplannable:
            self._unused += 1
            return None
        check = plan.reuse(tree)  # the plan must give back this very encoding, or it is not kept
        if check is None or check.tree_json != tree_json or list(check.tensors) != list(encoded.tensors):
            self._unused += 1
            return None
        return plan


_GIVE_UP = 3
_RETRY = 8
_SLOT = f"\x00lightning-resume-slot-{secrets.token_hex(16)}\x00"
"""Stands for a tensor-free subtree in a kept encoding's JSON text (no tree holds it: the split is checked)."""
_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_NEG = torch.Tensor.is_neg
_IS_CONJ = torch.Tensor.is_conj


def _read(ts: List[torch.Tensor], on_cpu: bool) -> Tuple[List[Any], List[int], bool]:
    """What a kept encoding compares of each tensor (dtype, shape, device or ``is_cpu``, ``requires_grad``,
    four entries each in one flat list), its data pointer, and whether all are contiguous with no negative
    bit. One pass over the tensors, each read once while in cache: a C-level pass per attribute was slower,
    fetching every tensor's metadata from memory again."""
    facts: List[Any] = []
    ptrs: List[int] = []
    fact, ptr = facts.extend, ptrs.append
    plain = True
    if on_cpu:
        for t in ts:
            fact((t.dtype, t.shape, t.is_cpu, t.requires_grad))
            ptr(_DATA_PTR(t))
            if plain and (not _IS_CONTIGUOUS(t) or _IS_NEG(t)):
                plain = False
    else:
        for t in ts:
            fact((t.dtype, t.shape, t.device, t.requires_grad))
            ptr(_DATA_PTR(t))
            if plain and (not _IS_CONTIGUOUS(t) or _IS_NEG(t)):
                plain = False
    return facts, ptrs, plain


class _Unplannable(Exception):
    """The tree's tensors sit where a kept encoding cannot find them by structure alone."""


class _Found:
    """What matching a tree against a kept encoding collects, in walk order."""

    __slots__ = ("tensors", "leaves")

    def __init__(self) -> None:
        self.tensors: List[Any] = []
        self.leaves: List[Tuple[Any, int]] = []  # a tensor-free subtree, and how many containers are above it


class _Node:
    """One place of a kept encoding's skeleton: :meth:`collect` checks a value has its shape there."""

    def collect(self, x: Any, found: _Found) -> bool:
        raise NotImplementedError


class _TensorAt(_Node):
    def collect(self, x: Any, found: _Found) -> bool:
        found.tensors.append(x)  # its type and metadata are checked for all tensors at once, later
        return True


class _LeafAt(_Node):
    def __init__(self, depth: int) -> None:
        self.depth = depth

    def collect(self, x: Any, found: _Found) -> bool:
        found.leaves.append((x, self.depth))
        return True


class _MappingAt(_Node):
    """A dict-like container; ``children`` ``None``: every value is a tensor (taken in one C-level pass)."""

    def __init__(self, cls: type, keys: Tuple, children: Optional[List[_Node]]) -> None:
        self.cls: Any = cls  # Any: ``type(x) is self.cls`` must not narrow ``x`` to ``object``
        self.keys, self.key_types, self.children = keys, tuple(map(type, keys)), children

    def collect(self, x: Any, found: _Found) -> bool:
        if type(x) is not self.cls or len(x) != len(self.keys):
            return False
        keys = tuple(x)
        if keys != self.keys or tuple(map(type, keys)) != self.key_types:  # 1 == True == 1.0: types too
            return False
        if self.children is None:
            found.tensors.extend(x.values())
            return True
        return all(node.collect(v, found) for node, v in zip(self.children, x.values(), strict=True))


class _MappingOfTensorMappingsAt(_MappingAt):
    """A dict-like container of dict-likes of tensors with the same string keys (an optimizer's per-parameter
    state): checked and collected in a few C-level passes, whatever the number of parameters."""

    def __init__(self, cls: type, keys: Tuple, inner: _MappingAt) -> None:
        super().__init__(cls, keys, None)
        self.inner_cls: Any = inner.cls
        self.inner_keys = inner.keys

    def collect(self, x: Any, found: _Found) -> bool:
        if type(x) is not self.cls or len(x) != len(self.keys):
            return False
        keys = tuple(x)
        if keys != self.keys or tuple(map(type, keys)) != self.key_types:
            return False
        inner = tuple(x.values())
        if set(map(type, inner)) != {self.inner_cls} or set(map(tuple, inner)) != {self.inner_keys}:
            return False
        if set(map(type, chain.from_iterable(inner))) != {str}:
            return False
        found.tensors.extend(chain.from_iterable(map(self.inner_cls.values, inner)))
        return True


class _SequenceAt(_Node):
    """A list or tuple; ``children`` ``None``: every item is a tensor."""

    def __init__(self, cls: type, length: int, children: Optional[List[_Node]]) -> None:
        self.cls: Any = cls
        self.length, self.children = length, children

    def collect(self, x: Any, found: _Found) -> bool:
        if type(x) is not self.cls or len(x) != self.length:
            return False
        if self.children is None:
            found.tensors.extend(x)
            return True
        return all(node.collect(v, found) for node, v in zip(self.children, x, strict=True))


_TENSOR = _TensorAt()
_PLANNED_MAPPINGS: Dict[str, type] = {tag: cls for cls, tag in _MAPPINGS.items() if tag != "namespace"}


class _Planner:
    """Builds a kept encoding's skeleton and JSON template from an encoded tree (post-order)."""

    def __init__(self) -> None:
        self.names: List[str] = []  # per tensor place, in walk order
        self.params: List[bool] = []
        self.grads: List[bool] = []
        self.slots = 0
        self.depth = 0  # of the deepest container in the skeleton

    def node(self, enc: Any, depth: int) -> Tuple[Optional[_Node], Any]:
        """The skeleton and template of an encoded subtree; ``(None, enc)`` if it holds no tensor."""
        if type(enc) is list:
            return self.sequence(list, enc, enc, depth, lambda items: items)
        if type(enc) is not dict:
            return None, enc
        tag = enc.get("@")
        if tag == "tensor":
            self.names.append(enc["k"])
            self.params.append(bool(enc.get("param")))
            self.grads.append(bool(enc.get("grad")))
            return _TENSOR, enc
        if tag == "tuple":
            return self.sequence(tuple, enc, enc["v"], depth, lambda items: {"@": "tuple", "v": items})
        if tag in _PLANNED_MAPPINGS:
            return self.mapping(tag, enc, depth)
        if _mentions_tensor(enc):
            raise _Unplannable(f"a tensor inside a {tag!r} node")
        return None, enc

    def sequence(
        self, cls: type, enc: Any, items: List[Any], depth: int, wrap: Callable[[List[Any]], Any]
    ) -> Tuple[Optional[_Node], Any]:
        planned = [self.node(v, depth + 1) for v in items]
        if all(node is None for node, _ in planned):
            return None, enc
        children = self.children(planned, depth)
        template = wrap([_SLOT if node is None else t for node, t in planned])
        return _SequenceAt(cls, len(items), None if all(c is _TENSOR for c in children) else children), template

    def mapping(self, tag: str, enc: Dict[str, Any], depth: int) -> Tuple[Optional[_Node], Any]:
        pairs = list(enc["v"].items()) if "v" in enc else [(p[0], p[1]) for p in enc["i"]]
        planned = [self.node(v, depth + 1) for _, v in pairs]
        if all(node is None for node, _ in planned):
            return None, enc
        keys = tuple(k for k, _ in pairs)
        if not all(type(k) in (str, int) for k in keys):  # other keys are tagged nodes, not plain values
            raise _Unplannable("a mapping with tensors and keys other than strings and ints")
        children = self.children(planned, depth)
        values = [_SLOT if node is None else t for node, t in planned]
        template = (
            {"@": tag, "v": dict(zip(keys, values, strict=True))}
            if "v" in enc
            else {"@": tag, "i": [[k, v] for k, v in zip(keys, values, strict=True)]}
        )
        cls = _PLANNED_MAPPINGS[tag]
        if all(c is _TENSOR for c in children):
            return _MappingAt(cls, keys, None), template
        first = children[0]
        if (
            isinstance(first, _MappingAt)
            and first.children is None
            and set(first.key_types) == {str}
            and all(type(c) is _MappingAt and (c.cls, c.keys) == (first.cls, first.keys) for c in children)
            and all(c.children is None for c in children if isinstance(c, _MappingAt))
        ):
            return _MappingOfTensorMappingsAt(cls, keys, first), template
        return _MappingAt(cls, keys, children), template

    def children(self, planned: List[Tuple[Optional[_Node], Any]], depth: int) -> List[_Node]:
        self.depth = max(self.depth, depth)
        if depth >= REUSE_DEPTH:
            raise _Unplannable(f"tensors nested deeper than REUSE_DEPTH={REUSE_DEPTH}")
        self.slots += sum(node is None for node, _ in planned)
        return [_LeafAt(depth + 1) if node is None else node for node, _ in planned]


def _mentions_tensor(enc: Any) -> bool:
    """Whether an encoded subtree may refer to a tensor (conservative: a string "tensor" under "@" counts)."""
    if type(enc) is list:
        return any(map(_mentions_tensor, enc))
    if type(enc) is dict:
        return enc.get("@") in ("tensor", "ndarray") or any(map(_mentions_tensor, enc.values()))
    return False


class _Plan:
    """One tree's encoding kept for the next save: its skeleton, its JSON text around the tensor-free
    subtrees, and what its tensors were (to compare the next tree's with, in C-level passes)."""

    def __init__(self, encoded: Encoded, tree_json: str) -> None:
        planner = _Planner()
        root, template = planner.node(encoded.tree, 0)
        if root is None:
            root, template, planner.slots = _LeafAt(0), _SLOT, 1
        self.root, self.depth, self.registrations = root, planner.depth, _registrations
        self.fragments = to_json(template).split(to_json(_SLOT))
        if len(self.fragments) != planner.slots + 1:
            raise _Unplannable("the slot marker occurs in the tree itself")
        names = planner.names
        tensors = [encoded.tensors[name] for name in names]
        self.types = tuple(torch.nn.Parameter if p else torch.Tensor for p in planner.params)
        dtypes, shapes, devices = [t.dtype for t in tensors], [t.shape for t in tensors], [t.device for t in tensors]
        self.on_cpu = all(d.type == "cpu" for d in devices)
        self.facts = [
            x
            for t, g in zip(tensors, planner.grads, strict=True)
            for x in (t.dtype, t.shape, True if self.on_cpu else t.device, g)
        ]  # as _read gives them; not the layout: a tensor that is not strided has no data pointer (it raises)
        self.static = list(zip(dtypes, shapes, devices, strict=True))
        self.complex = [i for i, t in enumerate(tensors) if t.is_complex()]  # the conj bit exists only there
        first: Dict[str, int] = {}
        self.reps = tuple(first.setdefault(name, i) for i, name in enumerate(names))  # equal names: aliases
        self.unique_names = list(encoded.tensors)
        self.unique = None if len(first) == len(names) else list(first.values())
        self.empty = [i for i, t in enumerate(tensors) if t.numel() == 0]
        self.last_ptrs = list(map(_DATA_PTR, tensors))
        self._group_by_pointer(self._pointers(self.last_ptrs), tensors)
        self.reused = False

    def reuse(self, tree: Any) -> Optional[TreeText]:
        """The encoding of ``tree`` if it has this plan's signature, else ``None`` (encode it in full)."""
        if self.registrations != _registrations or self.depth >= MAX_DEPTH:
            return None
        found = _Found()
        try:
            if not self.root.collect(tree, found):
                return None
            ts = found.tensors
            if len(ts) != len(self.types) or tuple(map(type, ts)) != self.types:
                return None
            facts, ptrs, plain = _read(ts, self.on_cpu)
            if facts != self.facts or not self._same_aliases(ts, ptrs):
                return None
            plain = plain and self.on_cpu and not any(_IS_CONJ(ts[i]) for i in self.complex)
            tree_json = self._text(found.leaves)
        except Exception:  # noqa: BLE001 - whatever went wrong, the full encoder decides (and names the error)
            return None
        if tree_json is None:
            return None
        if self.unique is not None:
            ts, ptrs = [ts[i] for i in self.unique], [ptrs[i] for i in self.unique]
        return TreeText(tree_json, dict(zip(self.unique_names, ts, strict=True)), self, ptrs, plain)

    def _pointers(self, ptrs: List[int]) -> List[int]:
        """``ptrs`` as aliasing sees them: an empty tensor aliases nothing, whatever its pointer."""
        if self.empty:
            ptrs = list(ptrs)
            for i in self.empty:
                ptrs[i] = -1 - i
        return ptrs

    def _group_by_pointer(self, ptrs: List[int], ts: List[torch.Tensor]) -> None:
        """Which places share a data pointer, and the strides of those that do: all the next save must
        compare to know its tensors alias as these did (dtype, shape and device are compared anyway)."""
        first: Dict[int, int] = {}
        self.by_pointer = list(map(first.setdefault, ptrs, range(len(ptrs))))
        shared = collections.Counter(self.by_pointer)
        self.sharing = [i for i, r in enumerate(self.by_pointer) if shared[r] > 1]
        self.sharing_strides = [ts[i].stride() for i in self.sharing]

    def _same_aliases(self, ts: List[torch.Tensor], data_ptrs: List[int]) -> bool:
        if data_ptrs == self.last_ptrs and not self.sharing:  # the same memory as last time
            return True
        ptrs = self._pointers(data_ptrs)
        if not self.sharing:  # no two shared a pointer: if none do now, none alias, as then
            if len(set(ptrs)) == len(ptrs):
                self.last_ptrs = data_ptrs
                return True
        else:
            first: Dict[int, int] = {}
            same_groups = list(map(first.setdefault, ptrs, range(len(ptrs)))) == self.by_pointer
            if same_groups and [ts[i].stride() for i in self.sharing] == self.sharing_strides:
                return True
        seen: Dict[Tuple, int] = {}  # grouped otherwise: compare the full alias keys
        keys = zip(ptrs, map(_STRIDE, ts), self.static, strict=True)
        if tuple(map(seen.setdefault, keys, range(len(ts)))) != self.reps:
            return False
        self.last_ptrs = data_ptrs
        self._group_by_pointer(ptrs, ts)
        return True

    def _text(self, leaves: List[Tuple[Any, int]]) -> Optional[str]:
        """The JSON text with each tensor-free subtree encoded afresh (``None``: one now holds a tensor)."""
        frags = self.fragments
        parts = [frags[0]]
        limit = min(MAX_DEPTH, REUSE_DEPTH)
        encoder = _Encoder()
        for (x, depth), frag in zip(leaves, frags[1:], strict=True):
            t = type(x)
            if t is str:
                parts.append(encode_basestring_ascii(x))
            elif t is int and -_INT64 < x < _INT64:
                parts.append(int.__repr__(x))
            elif x is None or t is bool:
                parts.append("null" if x is None else "true" if x else "false")
            else:
                encoder.depth_limit = limit - depth
                value = encoder.node(x, "")
                if encoder.out.tensors:
                    return None
                parts.append(_JSON.encode(value))
            parts.append(frag)
        return "".join(parts)


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
            "lightning_resume.format.codec.MAX_TREE_NODES to read it"
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
            f"MAX_HASH_COLLISIONS={MAX_HASH_COLLISIONS} (raise lightning_resume.format.codec.MAX_HASH_COLLISIONS)"
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
