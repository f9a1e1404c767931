"""Cache backends by name: pluggy hookspecs, the backend registry and entry-point loading.

A backend is a named factory `factory(config, **options) -> transformers.Cache`. Plugins add backends through one
registrar hook, and are found through the `hf_paged` entry-point group:

    # pyproject.toml of a plugin package
    [project.entry-points.hf_paged]
    my_backend = "my_package.hf_paged_plugin"

    # my_package/hf_paged_plugin.py
    import hf_paged

    @hf_paged.hookimpl
    def hf_paged_register_backends(register):
        register("my-backend", my_factory, description="...")

The built-in backends ("dynamic", "static", "paged") live in the `hf_paged_plugins` package (the top-level `plugins/`
folder) and are registered through the same entry points; nothing here imports them by name except the fallback for
an installation without entry-point metadata.

Environment:
    HF_PAGED_STRICT_PLUGINS=1            a plugin that fails to load raises instead of warning.
    HF_PAGED_DISABLE_PLUGIN_AUTOLOAD=1   skip third-party entry points; the built-in backends stay available.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pluggy
import torch
from transformers import Cache, PreTrainedConfig

from .errors import BackendOptionError, DuplicateBackend, PluginLoadError, PluginLoadWarning, UnknownBackend

PROJECT_NAME = "hf_paged"
ENTRY_POINT_GROUP = "hf_paged"
BUILTIN_PACKAGE = "hf_paged_plugins"
# Used only when the installed metadata lacks a built-in entry point (e.g. a stale editable install).
BUILTIN_PLUGINS = {name: f"{BUILTIN_PACKAGE}.{name}" for name in ("dynamic", "static", "paged")}

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class HookSpecs:
    """The hooks a plugin may implement (mark implementations with `hf_paged.hookimpl`)."""

    @hookspec
    def hf_paged_register_backends(self, register: Callable[..., None]) -> None:
        """Add backends by calling `register(name, factory, *, description="")` once per backend.

        `factory(config, **options)` gets the decoder text config of the model and returns a `transformers.Cache`.
        Its keyword parameters are the options `create_cache` accepts; a parameter named `dtype` or `device` also
        receives the model's dtype/device when a model (not a bare config) is given and the caller did not set it.
        """


@dataclass(frozen=True)
class Backend:
    name: str
    factory: Callable[..., Cache]
    description: str
    plugin: str  # name of the plugin that registered it


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class BackendRegistry:
    """Backends by name, collected from pluggy plugins. Entry points are loaded lazily, on the first lookup.

    Args:
        strict (`bool`, *optional*): raise `PluginLoadError` when a plugin fails to load, instead of warning and
            skipping it. Defaults to the env var `HF_PAGED_STRICT_PLUGINS`, read at load time.
        autoload (`bool`, *optional*): load third-party entry points. Defaults to not
            `HF_PAGED_DISABLE_PLUGIN_AUTOLOAD`, read at load time. Built-in backends are always loaded.
    """

    def __init__(self, *, strict: bool | None = None, autoload: bool | None = None):
        self.strict = strict
        self.autoload = autoload
        self.reset()

    def reset(self) -> None:
        """Forget every plugin and backend; the next lookup loads entry points again."""
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(HookSpecs)
        self._backends: dict[str, Backend] = {}
        self._failed: dict[str, Exception] = {}  # plugin description -> the error that stopped it
        self._sources: dict[str, str] = {}  # plugin name -> where it came from, for messages
        self._skipped_third_party = False
        self._loaded = False

    # ----------------------------------------------------------------------------------------------- loading
    def _is_strict(self, strict: bool | None = None) -> bool:
        if strict is not None:
            return strict
        return self.strict if self.strict is not None else _env_flag("HF_PAGED_STRICT_PLUGINS")

    def load_plugins(self, strict: bool | None = None) -> None:
        """Load the `hf_paged` entry points now (a lookup does it on demand). Idempotent.

        In strict mode this raises `PluginLoadError` if any plugin failed to load, now or in an earlier load.
        """
        strict = self._is_strict(strict)
        if not self._loaded:
            self._loaded = True  # set first: a strict failure below leaves the successful plugins registered
            autoload = self.autoload if self.autoload is not None else not _env_flag("HF_PAGED_DISABLE_PLUGIN_AUTOLOAD")
            found_builtins = set()
            # Built-ins first, so a third-party plugin reusing a built-in name is the one rejected.
            entry_points = sorted(
                importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                key=lambda ep: (not self._is_builtin(ep), ep.name, ep.value),
            )
            for ep in entry_points:
                if self._is_builtin(ep):
                    found_builtins.add(ep.name)
                elif not autoload:
                    self._skipped_third_party = True
                    continue
                dist = f" from {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ""
                self._load_one(ep.name, f"entry point {ep.name} = {ep.value}{dist}", ep.load, strict)
            for name, module in BUILTIN_PLUGINS.items():
                if name not in found_builtins:
                    self._load_one(name, f"built-in module {module}", partial(importlib.import_module, module), strict)
        if self._failed and strict:
            raise PluginLoadError(
                f"{len(self._failed)} hf_paged plugin(s) failed to load (strict mode): {self._format_failures()}"
            ) from next(iter(self._failed.values()))

    @staticmethod
    def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
        return ep.module == BUILTIN_PACKAGE or ep.module.startswith(BUILTIN_PACKAGE + ".")

    def _load_one(self, name: str, source: str, load: Callable[[], object], strict: bool) -> None:
        """Import and register one plugin; on any error record it and warn (strict mode raises in load_plugins)."""
        try:
            self._add_plugin(load(), name, source)
        except Exception as error:
            description = f"{name!r} ({source})"
            self._failed[description] = error
            if not strict:
                warnings.warn(
                    f"hf_paged plugin {description} failed to load and was skipped: {type(error).__name__}: {error}",
                    PluginLoadWarning,
                    stacklevel=2,
                )

    def _format_failures(self) -> str:
        return "; ".join(f"{plugin}: {type(error).__name__}: {error}" for plugin, error in self._failed.items())

    def _add_plugin(self, plugin: object, name: str | None, source: str) -> str:
        """Register `plugin` with pluggy and collect its backends; all or nothing."""
        name = self._pm.register(plugin, name)
        self._sources[name] = source
        try:
            self._pm.check_pending()  # a misspelled hf_paged_* hook would otherwise be silently ignored
            backends = self._collect(plugin, name)
        except BaseException:
            self._pm.unregister(plugin)
            del self._sources[name]
            raise
        self._backends.update(backends)
        return name

    def _collect(self, plugin: object, plugin_name: str) -> dict[str, Backend]:
        backends: dict[str, Backend] = {}

        def register(name: str, factory: Callable[..., Cache], *, description: str = "") -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"backend name must be a non-empty str, got {name!r}")
            if not callable(factory):
                raise TypeError(f"backend {name!r}: factory must be callable, got {type(factory).__name__}")
            other = self._backends.get(name) or backends.get(name)
            if other is not None:
                raise DuplicateBackend(
                    f"backend {name!r} is registered by two plugins: {self._describe(other.plugin)} and "
                    f"{self._describe(plugin_name)}; backend names must be unique, rename or uninstall one"
                )
            backends[name] = Backend(name, factory, description, plugin_name)

        for impl in self._pm.hook.hf_paged_register_backends.get_hookimpls():
            if impl.plugin is plugin:
                # NOTE: each implementation is called directly (not through pm.hook) so that every backend is
                # attributed to the plugin that registered it; that is what names both sides of a duplicate.
                if impl.wrapper or impl.hookwrapper:
                    raise TypeError("hf_paged_register_backends cannot be a wrapper hook")
                impl.function(**{arg: register for arg in impl.argnames})
        return backends

    def _describe(self, plugin_name: str) -> str:
        source = self._sources.get(plugin_name)
        return f"{plugin_name!r} ({source})" if source else repr(plugin_name)

    def register_plugin(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object or module in-process (tests, notebooks); returns its plugin name.

        Errors raise at once (the plugin is then not registered), e.g. `DuplicateBackend`.
        """
        self.load_plugins()
        return self._add_plugin(plugin, name, f"registered in-process: {getattr(plugin, '__name__', plugin)!r}")

    # ------------------------------------------------------------------------------------------------ lookup
    @property
    def plugins(self) -> dict[str, str]:
        """Loaded plugins: plugin name -> where it came from (entry point and distribution, or in-process)."""
        self.load_plugins(strict=False)
        return dict(self._sources)

    @property
    def failed_plugins(self) -> dict[str, Exception]:
        """Plugins that failed to load: description -> the error. Never raises, even in strict mode."""
        self.load_plugins(strict=False)
        return dict(self._failed)

    def available_backends(self) -> dict[str, str]:
        """Backend name -> description, sorted by name."""
        self.load_plugins()
        return {name: self._backends[name].description for name in sorted(self._backends)}

    def get_backend(self, name: str) -> Backend:
        self.load_plugins()
        if name not in self._backends:
            message = f"unknown cache backend {name!r}; available: {', '.join(sorted(self._backends)) or '(none)'}"
            if self._failed:
                message += f"; plugins that failed to load: {self._format_failures()}"
            if self._skipped_third_party:
                message += "; third-party plugins were not loaded (HF_PAGED_DISABLE_PLUGIN_AUTOLOAD is set)"
            raise UnknownBackend(message)
        return self._backends[name]

    def create_cache(self, name: str, model_or_config: Any, **options: Any) -> Cache:
        """Build a cache of backend `name` for a model or its config.

        The factory gets the decoder text config. Given a model, its dtype and device are passed as `dtype`/`device`
        when the factory has parameters of those names and `options` does not set them.
        """
        backend = self.get_backend(name)
        model_config = getattr(model_or_config, "config", None)
        if isinstance(model_or_config, torch.nn.Module) and isinstance(model_config, PreTrainedConfig):
            config = model_config
            hints = {option: getattr(model_or_config, option, None) for option in ("dtype", "device")}
        elif isinstance(model_or_config, PreTrainedConfig):
            config, hints = model_or_config, {}
        else:
            raise TypeError(f"create_cache needs a transformers model or config, got {type(model_or_config).__name__}")
        config = config.get_text_config(decoder=True)

        accepted, required, any_keyword = _factory_options(backend.factory)
        if not any_keyword:
            unknown = sorted(set(options) - set(accepted))
            if unknown:
                raise BackendOptionError(
                    f"backend {name!r} does not accept option(s) {', '.join(unknown)}; "
                    f"it accepts: {', '.join(accepted) or '(no options)'}"
                )
        missing = [option for option in required if option not in options]
        if missing:
            raise BackendOptionError(
                f"backend {name!r} needs option(s) {', '.join(missing)}, e.g. "
                f"create_cache({name!r}, model, {missing[0]}=...); it accepts: {', '.join(accepted)}"
            )
        for option, value in hints.items():
            if option in accepted and option not in options and value is not None:
                options[option] = value

        cache = backend.factory(config, **options)
        if not isinstance(cache, Cache):
            raise TypeError(
                f"backend {name!r} (plugin {backend.plugin!r}) returned {type(cache).__name__}, "
                "not a transformers.Cache"
            )
        return cache


def _factory_options(factory: Callable) -> tuple[list[str], list[str], bool]:
    """(accepted option names, required option names, takes **kwargs) of `factory(config, **options)`."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature: let the factory judge its options
        return [], [], True
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    options = [p for p in parameters[1:] if p.kind in named]  # parameters[0] receives the config
    accepted = [p.name for p in options]
    required = [p.name for p in options if p.default is inspect.Parameter.empty]
    return accepted, required, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


# The one piece of module-level mutable state: the default registry behind the module-level functions.
# Tests build their own `BackendRegistry()` or call `registry.reset()`.
registry = BackendRegistry()


def available_backends() -> dict[str, str]:
    """Names and descriptions of every cache backend of the default registry."""
    return registry.available_backends()


def create_cache(name: str, model_or_config: Any, **options: Any) -> Cache:
    """Build a `transformers.Cache` of backend `name` ("dynamic", "static", "paged", ...) for a model or config.

    >>> cache = create_cache("paged", model, block_size=16)
    >>> model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    """
    return registry.create_cache(name, model_or_config, **options)
