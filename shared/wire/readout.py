"""A read-out message filled by field name from the objects that hold its values.

Some messages are built at one edge from state that is not one plain mirror of them
(EngineStatus from the scheduler's stats and its diagnosis, a GenerateFinal's
RequestTimings from a choice, a worker's HandshakeResponse): no dataclass pairs with
them (shared/wire/mapper.py), but most of their fields are held somewhere under the
same name. message_from walks the message descriptor and takes each field from the
first source that holds its name, so a field added to the proto and to the object of
its value (a new SchedulerStats counter, say) is carried without editing the builder.
What a source names otherwise, or computes, is given by keyword. A field that no
source holds raises WireMismatch naming it: the builder fails, not the reader later
(tests/wire/test_hand_built_fields.py calls each builder with every field away from
its default).

Read-outs only: these run once per request or per status call, never per step in a
loop, so the descriptor is walked each call (a few microseconds).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.wire.mapper import WireMismatch

_NOTHING = object()


def message_from(msg: type, *sources: object, **given: object):
    """msg(each field: given[name], else the first source holding the name, a mapping's
    key or an object's attribute). A value of None leaves the field unset."""
    fields = msg.DESCRIPTOR.fields_by_name
    unknown = given.keys() - fields.keys()
    if unknown:
        raise WireMismatch(f"{msg.DESCRIPTOR.name} has no field {sorted(unknown)}")
    values = {}
    for name in fields:
        value = given.get(name, _NOTHING)
        for source in sources if value is _NOTHING else ():
            value = source.get(name, _NOTHING) if isinstance(source, Mapping) \
                else getattr(source, name, _NOTHING)
            if value is not _NOTHING:
                break
        if value is _NOTHING:
            raise WireMismatch(f"{msg.DESCRIPTOR.name}.{name}: no value given and no source "
                               f"holds {name!r} ({', '.join(type(s).__name__ for s in sources)})")
        if value is not None:
            values[name] = value
    return msg(**values)
