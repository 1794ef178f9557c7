"""The installed vLLM's ``SupportsEagle3`` Protocol, and how a class stands against it.

Members are read from the installed Protocol (they differ between releases: 0.26 renamed the getter to
``get_eagle3_default_aux_hidden_state_layers``), never from a hard-coded list.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass
from typing import Any

from eagle3lab import vllm_compat

# The Protocol's bookkeeping attributes that are not part of its contract.
_PROTOCOL_NOISE = frozenset(
    {
        "__abstractmethods__", "__annotations__", "__dict__", "__doc__", "__init__", "__module__",
        "__new__", "__slots__", "__subclasshook__", "__weakref__", "__class_getitem__",
        "__parameters__", "__orig_bases__", "__protocol_attrs__", "__non_callable_proto_members__",
        "__static_attributes__", "__firstlineno__", "__type_params__", "__annotate__",
        "__annotate_func__", "__annotations_cache__", "_is_protocol", "_is_runtime_protocol",
        "__callable_proto_members_only__", "__qualname__", "_abc_impl",
    }
)



def _protocol_members(proto: type) -> list[str]:
    """Members a Protocol requires, read from the Protocol itself (never from a hard-coded list)."""
    attrs = getattr(proto, "__protocol_attrs__", None)  # Python >= 3.12 caches them here
    if attrs is None:
        getter = getattr(typing, "_get_protocol_attrs", None)  # Python 3.10 / 3.11
        if getter is not None:
            try:
                attrs = getter(proto)
            except Exception:  # private helper: fall back to reading the class dicts
                attrs = None
    if attrs is None:
        attrs = set()
        for base in proto.__mro__:
            if base in (object, typing.Protocol, typing.Generic):
                continue
            attrs.update(base.__dict__)
            attrs.update(getattr(base, "__annotations__", {}) or {})
    return sorted(a for a in attrs if a not in _PROTOCOL_NOISE and not a.startswith("_abc_"))



def eagle3_protocol_members() -> list[str]:
    """Names the installed vLLM's ``SupportsEagle3`` Protocol requires (they differ between releases)."""
    return _protocol_members(vllm_compat.interfaces().SupportsEagle3)


@dataclass
class InterfaceReport:
    """How one class stands against the installed ``SupportsEagle3`` Protocol."""

    class_name: str
    module: str
    supports_eagle3: bool
    members_present: list[str]
    members_missing: list[str]
    protocol_members: list[str]
    # True when SupportsEagle3 is among the class's bases (nominal), not only matched structurally.
    nominal: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def interface_report(cls: type) -> InterfaceReport:
    """Check ``cls`` (a class, or an instance whose class is used) against ``SupportsEagle3``.

    ``supports_eagle3`` is vLLM's own verdict (``supports_eagle3(cls)``); the member lists are
    ``hasattr`` checks of each member of the installed Protocol, so a patch can be shown before/after.
    """
    if cls is None:
        raise ValueError("interface_report: got None instead of a class (did the registry fail to resolve it?)")
    if not isinstance(cls, type):
        cls = type(cls)
    interfaces = vllm_compat.interfaces()
    members = _protocol_members(interfaces.SupportsEagle3)
    return InterfaceReport(
        class_name=cls.__name__,
        module=cls.__module__,
        supports_eagle3=bool(interfaces.supports_eagle3(cls)),
        members_present=[m for m in members if hasattr(cls, m)],
        members_missing=[m for m in members if not hasattr(cls, m)],
        protocol_members=members,
        nominal=interfaces.SupportsEagle3 in cls.__mro__,
    )


def implemented_interfaces(cls: type) -> list[str]:
    """The runtime-checkable ``Supports*`` / ``Has*`` / ``Is*`` Protocols of vLLM that ``cls`` satisfies."""
    interfaces = vllm_compat.interfaces()
    out = []
    for name, obj in vars(interfaces).items():
        if not (isinstance(obj, type) and getattr(obj, "_is_runtime_protocol", False)):
            continue
        if not name.startswith(("Supports", "Has", "Is")):
            continue
        try:
            # isinstance on the class object: Protocols with data members refuse issubclass.
            if isinstance(cls, obj):
                out.append(name)
        except TypeError:
            continue
    return sorted(out)

