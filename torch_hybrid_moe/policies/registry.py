"""Name -> factory registries, so a config string picks a policy and new policies plug in by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of policy factories of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def add(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return add

    def names(self) -> list[str]:
        return sorted(self._factories)

    def check(self, name: str) -> None:
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")

    def create(self, name: str, **context: object) -> T:
        """Build `name` from the context on offer (layer info, costs, timeline, future routing, request
        tracker, router...): each factory takes the keys its signature names and ignores the rest, so callers
        offer everything they have and a policy that lacks what it needs says so itself."""
        self.check(name)
        factory = self._factories[name]
        params = inspect.signature(factory).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            names = {p.name for p in params}
            context = {k: v for k, v in context.items() if k in names}
        return factory(**context)
