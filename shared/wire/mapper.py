"""One mapper between a protobuf message and the plain dataclass of the same fields,
derived from the message descriptor instead of written out field by field.

Fields correspond by name (a pair may rename a few). Per field, from the descriptor
and the dataclass's type hints:

    scalar                    copied
    `optional` scalar         unset <-> the dataclass default (None where that is None)
    repeated                  list (a `set[...]` hint: a set, sorted on the wire)
    map                       dict
    enum                      IntEnum; value 0 (UNSPECIFIED) <-> None where the default is None
    message                   its registered counterpart, recursively (repeated, map values too);
                              a dataclass default of None: unset <-> None

A pair lists the fields whose shape really differs with hand functions (`hand_to`:
proto field -> fn(obj); `hand_from`: attribute -> fn(msg), or columns(fn, *attrs)
for attributes one pass over the message fills together). Building a pair raises
WireMismatch when a field on either side has no counterpart, so a proto field nobody
maps fails every import, not a request at run time.

The per-pair functions are generated once, at import, as Python source (like
dataclasses' __init__): the Step stream converts hundreds of requests a step, and
generated code runs as fast as the same mapping written by hand
(benchmarks/wire_convert.py --baseline benchmarks/wire_hand_reference.py): the
dataclass is called with positional arguments in its field order, HasField is
looked up once per message, and columns read from rows take one pass.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf.descriptor import FieldDescriptor


class WireMismatch(TypeError):
    """A proto message and its dataclass do not correspond."""


@dataclass
class Pair:
    """A message type and its plain counterpart, with the generated mapping."""

    msg: type
    py: type  # the dataclass, or tuple / list for the small shapes below
    to_proto: Callable | None = None
    from_proto: Callable | None = None
    source: str = ""  # the generated code, for reading and debugging
    # how each nested use inlines it: a format string over the value's expression
    to_expr: str = ""
    from_expr: str = ""
    namespace: dict = field(default_factory=dict)
    renames: dict = field(default_factory=dict)
    hand_to: dict = field(default_factory=dict)
    hand_from: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.msg.DESCRIPTOR.name


_PAIRS: dict[str, Pair] = {}  # by message full name
_ENUMS: dict[str, type[enum.IntEnum]] = {}  # by enum full name


def pairs() -> list[Pair]:
    return list(_PAIRS.values())


def registered(msg: type) -> Pair | None:
    return _PAIRS.get(msg.DESCRIPTOR.full_name)


def register_enum(proto_enum, py_enum: type[enum.IntEnum]) -> None:
    """Pair a generated enum (its module attribute) with an IntEnum of the same values."""
    desc = proto_enum.DESCRIPTOR
    wire = {v.number for v in desc.values if v.number != 0}
    if wire != {int(v) for v in py_enum}:
        raise WireMismatch(f"enum {desc.name}: values {sorted(wire)} on the wire, "
                           f"{sorted(int(v) for v in py_enum)} in {py_enum.__qualname__}")
    _ENUMS[desc.full_name] = py_enum


def _register(p: Pair) -> Pair:
    _PAIRS[p.msg.DESCRIPTOR.full_name] = p
    return p


def tuple_shape(msg: type) -> Pair:
    """A small message <-> a tuple of its scalar fields in field order
    (TopLogprob <-> (token_id, logprob))."""
    names = [f.name for f in msg.DESCRIPTOR.fields]
    for f in msg.DESCRIPTOR.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE or f.is_repeated:
            raise WireMismatch(f"{msg.DESCRIPTOR.name}.{f.name}: a tuple shape holds scalars")
    key = f"_M_{msg.DESCRIPTOR.name}"
    to_expr = key + "(" + ", ".join(f"{n}={{0}}[{i}]" for i, n in enumerate(names)) + ")"
    from_expr = "(" + ", ".join(f"{{0}}.{n}" for n in names) + ",)"
    return _register(_compile(Pair(msg, tuple, to_expr=to_expr, from_expr=from_expr,
                                   namespace={key: msg})))


def unwrap_shape(msg: type) -> Pair:
    """A message whose only field is a repeated scalar <-> that list
    (BlockIds <-> list[int]: proto has no list of lists)."""
    fields = msg.DESCRIPTOR.fields
    if len(fields) != 1 or not fields[0].is_repeated or \
            fields[0].type == FieldDescriptor.TYPE_MESSAGE:
        raise WireMismatch(f"{msg.DESCRIPTOR.name}: an unwrap shape has one repeated scalar")
    key, name = f"_M_{msg.DESCRIPTOR.name}", fields[0].name
    return _register(_compile(Pair(msg, list, to_expr=f"{key}({name}={{0}})",
                                   from_expr=f"list({{0}}.{name})", namespace={key: msg})))


@dataclass(frozen=True, eq=False)
class Columns:
    """Several attributes read from a message in one pass (hand_from): fn(msg) returns
    their values, in the order of attrs. Build it with columns()."""

    fn: Callable
    attrs: tuple[str, ...]


def columns(fn: Callable, *attrs: str) -> dict[str, Columns]:
    """hand_from entries for attributes that one pass over the message fills together
    (ModelRunnerOutput's rows -> its columns): `hand_from=columns(fn, "a", "b")`."""
    both = Columns(fn, attrs)
    return {a: both for a in attrs}


def pair(py: type, msg: type, *, renames: dict[str, str] | None = None,
         hand_to: dict[str, Callable] | None = None,
         hand_from: dict[str, Callable | Columns] | None = None,
         register: bool = True) -> Pair:
    """Pair dataclass `py` with message `msg`. renames: proto field -> attribute;
    register=False leaves it out of the registry (nested uses, pairs())."""
    renames, hand_to, hand_from = renames or {}, hand_to or {}, hand_from or {}
    problems = mismatches(py, msg, renames, hand_to, hand_from)
    if problems:
        raise WireMismatch(f"{msg.DESCRIPTOR.name} <-> {py.__qualname__}: " + "; ".join(problems))
    hints = typing.get_type_hints(py)
    attrs = {f.name: f for f in dataclasses.fields(py)}
    ns: dict = {"_M": msg, "_P": py}
    to_args, from_exprs = [], {}
    for f in msg.DESCRIPTOR.fields:
        if f.name in hand_to:
            ns[f"_h_{f.name}"] = hand_to[f.name]
            to_args.append(f"{f.name}=_h_{f.name}(o)")
            continue
        attr = renames.get(f.name, f.name)
        to_args.append(f"{f.name}={_to_expr(f, attrs[attr], hints[attr], ns, f'o.{attr}')}")
        if attr not in hand_from:
            from_exprs[attr] = _from_expr(f, attrs[attr], hints[attr], ns)
    body, passes = [], {}  # one call per Columns, however many attributes it fills
    for attr, fn in hand_from.items():
        if isinstance(fn, Columns):
            if id(fn) not in passes:
                passes[id(fn)] = k = len(passes)
                ns[f"_hc{k}"] = fn.fn
                body.append(f"_c{k} = _hc{k}(m)")
            from_exprs[attr] = f"_c{passes[id(fn)]}[{fn.attrs.index(attr)}]"
        else:
            ns[f"_hf_{attr}"] = fn
            from_exprs[attr] = f"_hf_{attr}(m)"
    if any("m.HasField(" in e for e in from_exprs.values()):  # looked up once
        body.append("_has = m.HasField")
        from_exprs = {a: e.replace("m.HasField(", "_has(") for a, e in from_exprs.items()}
    # positional, in the dataclass's field order: a step builds hundreds of these
    from_call = ", ".join(from_exprs[a] for a in attrs) if all(
        f.init and not f.kw_only for f in attrs.values()) else \
        ", ".join(f"{a}={from_exprs[a]}" for a in attrs)
    name = msg.DESCRIPTOR.name
    p = Pair(msg, py, to_expr=f"_to_{name}({{0}})", from_expr=f"_from_{name}({{0}})",
             namespace=ns, renames=renames, hand_to=hand_to, hand_from=hand_from)
    p.source = (f"def _to_{name}(o):\n    return _M({', '.join(to_args)})\n\n"
                f"def _from_{name}(m):\n" + "".join(f"    {line}\n" for line in body)
                + f"    return _P({from_call})\n")
    exec(compile(p.source, f"<wire pair {name}>", "exec"), ns)  # noqa: S102 (our own text)
    p.to_proto, p.from_proto = ns[f"_to_{name}"], ns[f"_from_{name}"]
    return _register(p) if register else p


def mismatches(py: type, msg: type, renames: dict[str, str] | None = None,
               hand_to: dict | None = None, hand_from: dict | None = None) -> list[str]:
    """What keeps `py` and `msg` from corresponding, one line each (empty: they do)."""
    renames, hand_to, hand_from = renames or {}, hand_to or {}, hand_from or {}
    hints = typing.get_type_hints(py)
    attrs = {f.name for f in dataclasses.fields(py)}
    wire = {f.name: f for f in msg.DESCRIPTOR.fields}
    out = [f"{n!r} is renamed/hand-mapped but is no field of {msg.DESCRIPTOR.name}"
           for n in (renames.keys() | hand_to.keys()) - wire.keys()]
    out += [f"{a!r} is hand-mapped but is no field of {py.__qualname__}"
            for a in hand_from.keys() - attrs]
    covered = set(hand_from)
    for name, f in wire.items():
        if name in hand_to:
            continue
        attr = renames.get(name, name)
        if attr not in attrs:
            out.append(f"proto field {name!r} has no counterpart in {py.__qualname__}")
            continue
        covered.add(attr)
        if attr not in hand_from:
            out += _shape_problem(f, attr, hints[attr])
    out += [f"{py.__qualname__}.{a} has no counterpart in proto {msg.DESCRIPTOR.name}"
            for a in sorted(attrs - covered)]
    return out


# ---------------------------------------------------------------------------
# per-field plans


def _is_map(f) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def _origin(hint):
    """list/set/dict for a container hint (through `| None`), else the hint itself."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return typing.get_origin(hint) or hint


def _shape_problem(f, attr: str, hint) -> list[str]:
    origin = _origin(hint)
    shown = getattr(origin, "__name__", origin)
    if _is_map(f):
        return [] if origin is dict else [f"{attr}: {shown} for the map field {f.name!r}"]
    if f.is_repeated:
        return [] if origin in (list, set) else \
            [f"{attr}: {shown} for the repeated field {f.name!r}"]
    return [f"{attr}: a container ({shown}) for the single field {f.name!r}"] \
        if origin in (list, set, dict) else []


def _nested(desc, ns: dict) -> Pair:
    p = _PAIRS.get(desc.full_name)
    if p is None:
        raise WireMismatch(f"message {desc.name} is used by a paired message but has no "
                           f"registered counterpart")
    ns.update(p.namespace if p.py in (tuple, list) else
              {f"_to_{p.name}": p.to_proto, f"_from_{p.name}": p.from_proto})
    return p


def _enum(f, ns: dict) -> str:
    py_enum = _ENUMS.get(f.enum_type.full_name)
    if py_enum is None:
        raise WireMismatch(f"enum {f.enum_type.name} has no registered IntEnum")
    key = f"_E_{f.enum_type.name}"
    ns[key] = py_enum
    return key


def _to_expr(f, attr: dataclasses.Field, hint, ns: dict, v: str) -> str:
    if _is_map(f):
        value = f.message_type.fields_by_name["value"]
        if value.type != FieldDescriptor.TYPE_MESSAGE:
            return v
        inner = _nested(value.message_type, ns).to_expr.format("x")
        return f"{{k: {inner} for k, x in {v}.items()}}"
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        inner = _nested(f.message_type, ns).to_expr
        if f.is_repeated:
            return f"[{inner.format('x')} for x in {v}]"
        if attr.default is None:  # an optional message: None stays unset
            return f"(None if {v} is None else {inner.format(v)})"
        return inner.format(v)
    if f.type == FieldDescriptor.TYPE_ENUM:
        _enum(f, ns)
        return f"int({v} or 0)" if attr.default is None else f"int({v})"
    if f.is_repeated and _origin(hint) is set:
        return f"sorted({v})"  # one order on the wire: steps compare equal byte for byte
    return v  # None for an `optional` field: the constructor leaves it unset


def _from_expr(f, attr: dataclasses.Field, hint, ns: dict) -> str:
    v = f"m.{f.name}"
    if _is_map(f):
        value = f.message_type.fields_by_name["value"]
        if value.type != FieldDescriptor.TYPE_MESSAGE:
            return f"dict({v})"
        inner = _nested(value.message_type, ns).from_expr.format("x")
        return f"{{k: {inner} for k, x in {v}.items()}}"
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        inner = _nested(f.message_type, ns).from_expr
        if f.is_repeated:
            return f"[{inner.format('x')} for x in {v}]"
        if attr.default is None:  # an optional message: unset reads as None
            return f"({inner.format(v)} if m.HasField({f.name!r}) else None)"
        return inner.format(v)
    if f.is_repeated:
        return f"set({v})" if _origin(hint) is set else f"list({v})"
    if f.type == FieldDescriptor.TYPE_ENUM:
        key = _enum(f, ns)
        return f"({key}({v}) if {v} else None)" if attr.default is None else f"{key}({v})"
    if f.has_presence:
        ns[f"_d_{attr.name}"] = None if attr.default is dataclasses.MISSING else attr.default
        return f"({v} if m.HasField({f.name!r}) else _d_{attr.name})"
    return v


def _compile(p: Pair) -> Pair:
    """The standalone functions of a tuple/unwrap shape, from its inline expressions."""
    name = p.name
    p.source = (f"def _to_{name}(o):\n    return {p.to_expr.format('o')}\n\n"
                f"def _from_{name}(m):\n    return {p.from_expr.format('m')}\n")
    ns = dict(p.namespace)
    exec(compile(p.source, f"<wire shape {name}>", "exec"), ns)  # noqa: S102 (our own text)
    p.to_proto, p.from_proto = ns[f"_to_{name}"], ns[f"_from_{name}"]
    return p


if __name__ == "__main__":  # python -m shared.wire.mapper: the generated code of every pair
    from shared.wire import engine, mapper, worker  # noqa: F401 (they register the pairs)
    for p in mapper.pairs():  # this file runs as __main__: the registry is the module's
        print(f"# {p.msg.DESCRIPTOR.full_name} <-> {p.py.__qualname__}\n{p.source}")
