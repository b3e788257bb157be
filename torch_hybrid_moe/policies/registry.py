"""Name -> factory registries, so a config string picks a policy and new policies plug in by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
# what callers offer every policy (`create`'s context), as opposed to a policy's own parameters (`options`)
CONTEXT = frozenset({"info", "costs", "timeline", "router", "size", "future", "request", "popularity", "residual"})


class Registry(Generic[T]):
    """A named collection of policy factories of one kind, and of the tensor forms (what a CUDA graph runs at
    replay) of those that have one: which policies run inside a graph is read from here, nowhere else."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._tensor_forms: dict[str, Callable[..., object]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def add(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return add

    def add_tensor_form(self, name: str, form: Callable[..., object]) -> None:
        """Pair the policy registered as `name` with its tensor form: `form(policy, ...)` builds it from the live
        policy object (its parameters); it must decide as the object does (each form has a test saying so)."""
        self.check(name)
        if name in self._tensor_forms:
            raise ValueError(f"{self.kind} {name!r} already has a tensor form")
        self._tensor_forms[name] = form

    def names(self) -> list[str]:
        return sorted(self._factories)

    def graph_names(self) -> list[str]:
        """The policies that can run inside a CUDA graph."""
        return sorted(self._tensor_forms)

    def tensor_form(self, name: str) -> Callable[..., Any]:
        """The tensor-form builder of `name`, or a one-line error naming those that have one. By name, not by the
        object's class: a policy subclassed under another name may decide differently, and gets no form."""
        self.check(name)
        if name not in self._tensor_forms:
            raise ValueError(
                f"{self.kind} {name!r} has no tensor form, so it cannot run inside a CUDA graph; use one "
                f"of {', '.join(map(repr, self.graph_names()))} or HybridMoEConfig(cuda_graph=False)"
            )
        return self._tensor_forms[name]

    def check(self, name: str) -> None:
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")

    def options(self, name: str) -> list[str]:
        """The parameters of `name` a user may set (`HybridMoEConfig.cache_options`): its own, not the context."""
        self.check(name)
        params = inspect.signature(self._factories[name]).parameters
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return sorted(n for n, p in params.items() if n not in CONTEXT and p.kind in keyword)

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
