"""The chart's scheduler.kvEventsLayout: the scheduler's --kv-events-config is vLLM's
own keys by default, and names our event_layout only when a router needs vLLM 0.23's
positional events (docs/kv_events.md); the value is read by the scheduler's own
config parser, as the pod would start it."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.kv_events import KVEventsConfig
from shared import config

from .helm_chart import VALUE_SETS, as_the_kubelet_starts_it, install


def scheduler_kv_config(values: dict) -> str | None:
    out = []
    for component, _, spec in install(values).workloads():
        if component == "scheduler":
            [container] = spec["containers"]
            args, env = as_the_kubelet_starts_it(container, {}, pod_index=0)
            out.append(config.parse_args(config.scheduler_parser(), args[1:],
                                         env).kv_events_config)
    assert len(set(out)) == 1, out
    return out[0]


@pytest.mark.parametrize("layout", [None, "map", "array"])
def test_the_layout_reaches_each_replicas_scheduler(layout):
    values = json.loads(json.dumps(VALUE_SETS["dp2"]))
    if layout is not None:
        values.setdefault("scheduler", {})["kvEventsLayout"] = layout
    text = scheduler_kv_config(values)
    assert ("event_layout" in json.loads(text)) == (layout == "array")
    assert KVEventsConfig.from_json(text).event_layout == (layout or "map")
