"""How a flag is declared, and what is built from a declaration: the argparse flags
(with one-line errors), a service's config dataclass (from_flags), what `gapserve
serve` forwards to a child, and a flag's environment variable's name. The flags
themselves are declared in shared/config.py, which also reads the environment."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields, make_dataclass

ENV_PREFIX = "GAPSERVE_"


def env_name(flag: str) -> str:
    """`--max-num-seqs` -> `GAPSERVE_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def group(title: str) -> Callable[..., Field]:
    """A field maker for one argparse group: `worker(16, "help", type=positive_int)`.
    A bool default makes a --x/--no-x switch. secret: `gapserve serve` hands it to its
    children in their environment, never on a command line. per_child: serve sets it
    for each child itself (--host), so it is not forwarded. aliases: other names of the
    same flag (vLLM's, e.g. --port for --http-port); only the first name is forwarded."""
    def declare(default=None, help: str | None = None, *, type=None, choices=None,
                metavar: str | None = None, secret: bool = False,
                per_child: bool = False, aliases: tuple[str, ...] = ()) -> Field:
        meta = {"group": title, "help": help, "type": type, "choices": choices,
                "metavar": metavar, "secret": secret, "per_child": per_child,
                "aliases": aliases}
        if isinstance(default, list):  # each parser gets its own
            return field(default_factory=lambda: list(default), metadata=meta)
        return field(default=default, metadata=meta)
    return declare


def flag_name(f: Field) -> str:
    return "--" + f.name.replace("_", "-")


def flag_default(f: Field):
    return f.default_factory() if f.default is MISSING else f.default


def add_flags(parser: argparse.ArgumentParser, *groups: type) -> None:
    """Add the flags of these group (or service) dataclasses to the parser."""
    made: dict[str, argparse._ArgumentGroup] = {}
    for f in (f for g in groups for f in fields(g)):
        m = f.metadata
        g = made.get(m["group"]) or made.setdefault(
            m["group"], parser.add_argument_group(m["group"]))
        default = flag_default(f)
        kwargs = {"default": default, "help": m["help"]}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update({k: m[k] for k in ("type", "choices", "metavar") if m[k] is not None})
        g.add_argument(flag_name(f), *m.get("aliases", ()), dest=f.name, **kwargs)


def service_flags(name: str, *groups: type) -> type:
    """One service's flags: the union of its groups, in order, as one dataclass (a
    name in two of its groups is a mistake, caught here)."""
    spec, seen = [], set()
    for group in groups:
        for f in fields(group):
            if f.name in seen:
                raise TypeError(f"{name}: --{f.name} is declared by two of its groups")
            seen.add(f.name)
            spec.append((f.name, f.type, field(default=f.default,
                                               default_factory=f.default_factory,
                                               metadata=f.metadata)))
    return make_dataclass(name, spec, frozen=True)


def flag_fields(config: type, flags: type,
                renames: Mapping[str, str] | None = None) -> dict[str, str]:
    """Which field of dataclass `config` each of `flags`' flags sets: {field: flag}.
    A field and a flag of the same name are one setting; `renames` (field -> flag)
    pairs the few whose names differ. A rename naming no field or no flag raises
    TypeError, so renaming a flag breaks its config at start, not silently."""
    renames = dict(renames or {})
    names = {f.name for f in fields(config)}
    declared = {f.name for f in fields(flags)}
    wrong = [f"{k} -> --{v.replace('_', '-')}" for k, v in renames.items()
             if k not in names or v not in declared]
    if wrong:
        raise TypeError(f"{config.__qualname__} from {flags.__qualname__}: no such field or "
                        f"flag in {', '.join(wrong)}")
    out = {name: name for name in names & declared if name not in renames}
    return out | renames


def from_flags(config: type, args: argparse.Namespace, flags: type, *,
               renames: Mapping[str, str] | None = None,
               unset: Mapping[str, object] | None = None):
    """An instance of dataclass `config` from a service's parsed flags (`flags`: its
    declaration in shared/config.py), by flag_fields. A flag left unset (None) keeps
    the field's default, or takes `unset[field]` where the setting has another source
    when no flag is given (the workers' handshake, an environment variable); `unset`
    also fills fields that no flag sets. An attribute missing from `args` counts as
    unset (a namespace built from some groups only)."""
    unset = dict(unset or {})
    names = {f.name for f in fields(config)}
    if not unset.keys() <= names:
        raise TypeError(f"{config.__qualname__} has no field {sorted(unset.keys() - names)}")
    values = dict(unset)
    for name, flag in flag_fields(config, flags, renames).items():
        value = getattr(args, flag, None)
        if value is not None:
            values[name] = value
    return config(**values)


def forwarded(args: argparse.Namespace, child: type) -> list[str]:
    """`gapserve serve`: the command line of a child taking `child`'s flags, from serve's
    parsed flags: every flag both take, but secrets (see secrets_env) and what serve
    sets per child. None = left unset."""
    out: list[str] = []
    for f in fields(child):
        if f.metadata["secret"] or f.metadata["per_child"] or not hasattr(args, f.name):
            continue
        value, flag = getattr(args, f.name), flag_name(f)
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, ",".join(map(str, value))]
        elif hasattr(value, "to_json"):  # a parsed JSON flag (--speculative-config)
            out += [flag, value.to_json()]
        else:
            out += [flag, str(value)]
    return out


def secrets_env(args: argparse.Namespace, child: type) -> dict[str, str]:
    """The child's secret flags that serve was given, as the child's variables (a
    command line is readable by any local user in the process list)."""
    out = {}
    for f in fields(child):
        value = getattr(args, f.name, None) if f.metadata["secret"] else None
        if value:
            out[env_name(flag_name(f))] = ",".join(value) if isinstance(value, list) \
                else str(value)
    return out



class FlagParser(argparse.ArgumentParser):
    """argparse, but an error is one line (exit 2), not the whole usage: with some sixty
    flags the usage buries the mistake. A mistyped flag names the closest flag."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            unknown = message.split(": ", 1)[1].split()
            flag = next((a for a in unknown if a.startswith("-")), unknown[0])
            known = [o for a in self._actions for o in a.option_strings]
            close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else f"; see {self.prog} --help"
            what = "unknown flag" if flag.startswith("-") else "unexpected argument"
            self.exit(2, f"{self.prog}: {what} {flag}{hint}\n")
        self.exit(2, f"{self.prog}: error: {message}\n")
