"""Workload files: {"groups": [{name, count, arrival_ms, prompt_tokens, output_tokens,
priority?, shared_prefix_tokens?}, ...]} turned into requests with arrival times.

`arrival_ms` is a number (all arrive then), a list of `count` times, or
{"start": ms, "interval": ms} (one every interval from start). Prompts are distinct
except for a group's first `shared_prefix_tokens` tokens, which all its requests share.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from scheduler_svc.core import Request
from shared.types import SamplingParams

EOS = 0  # never sampled by the simulated worker; outputs stop by length


class WorkloadError(ValueError):
    """A workload file that cannot be simulated; the message names the field."""


@dataclass(slots=True)
class Group:
    name: str
    count: int
    arrivals_ms: list[float]
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    shared_prefix_tokens: int = 0


@dataclass(slots=True)
class SimRequest:
    group: str
    arrival_ms: float
    request: Request


def load_workload(path: str) -> list[Group]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise WorkloadError(f"cannot read workload {path}: {err}") from err
    return parse_workload(data)


def parse_workload(data) -> list[Group]:
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
        raise WorkloadError('a workload is a JSON object {"groups": [...]} with at least one group')
    groups, names = [], set()
    for i, g in enumerate(data["groups"]):
        where = f"groups[{i}]"
        if not isinstance(g, dict):
            raise WorkloadError(f"{where} must be an object")
        unknown = set(g) - {"name", "count", "arrival_ms", "prompt_tokens", "output_tokens",
                            "priority", "shared_prefix_tokens"}
        if unknown:
            raise WorkloadError(f"{where} has unknown fields: {', '.join(sorted(unknown))}")
        name = g.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise WorkloadError(f"{where}.name must be a unique non-empty string")
        names.add(name)

        def integer(field, low, default=None):
            value = g.get(field, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise WorkloadError(f"{where} ({name}).{field} must be an integer >= {low}")
            return value

        count = integer("count", 1)
        prompt = integer("prompt_tokens", 1)
        output = integer("output_tokens", 1)
        priority = integer("priority", -(2**31), 0)
        shared = integer("shared_prefix_tokens", 0, 0)
        if shared > prompt:
            raise WorkloadError(f"{where} ({name}).shared_prefix_tokens exceeds prompt_tokens")
        groups.append(Group(name, count, _arrivals(g.get("arrival_ms"), count, f"{where} ({name})"),
                            prompt, output, priority, shared))
    return groups


def _arrivals(spec, count: int, where: str) -> list[float]:
    def ok(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0

    if ok(spec):
        return [float(spec)] * count
    if isinstance(spec, list) and len(spec) == count and all(ok(x) for x in spec):
        return [float(x) for x in spec]
    if isinstance(spec, dict) and set(spec) == {"start", "interval"} \
            and ok(spec["start"]) and ok(spec["interval"]):
        return [spec["start"] + k * spec["interval"] for k in range(count)]
    raise WorkloadError(f"{where}.arrival_ms must be a time >= 0, a list of `count` times, "
                        f'or {{"start": ms, "interval": ms}}')


def make_requests(groups: list[Group]) -> list[SimRequest]:
    """Requests in arrival order (ties: file order)."""
    out = []
    for gi, g in enumerate(groups):
        prefix = [1 + (gi * 7919 + j) % 40_000 for j in range(g.shared_prefix_tokens)]
        for k, arrival in enumerate(g.arrivals_ms):
            # A token no other request has right after the prefix keeps the rest distinct.
            unique = 50_000 + len(out)
            rest = [unique] + [1 + (unique * 31 + j) % 40_000
                               for j in range(g.prompt_tokens - g.shared_prefix_tokens - 1)]
            prompt = (prefix + rest)[:g.prompt_tokens]
            params = SamplingParams(max_tokens=g.output_tokens, ignore_eos=True)
            req = Request(f"{g.name}-{k}", prompt, params, [EOS], arrival, g.priority)
            out.append(SimRequest(g.name, arrival, req))
    out.sort(key=lambda r: r.arrival_ms)
    return out
