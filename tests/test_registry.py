"""Backend registry: in-process plugins, entry-point discovery, broken and duplicate plugins, error messages."""

import importlib.metadata
import sys
import textwrap
import warnings

import pluggy
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_paged.registry
from hf_paged.registry import (
    BackendOptionError,
    BackendRegistry,
    DuplicateBackend,
    PluginLoadError,
    PluginLoadWarning,
    UnknownBackend,
    hookimpl,
)

BUILTINS = {"dynamic", "paged", "static"}


def tiny_config(**overrides):
    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaConfig(**{**kwargs, **overrides})


def plugin_with(**factories):
    """A plugin object registering one backend per keyword: `plugin_with(toy=factory)`."""

    class Plugin:
        @hookimpl
        def hf_paged_register_backends(self, register):
            for name, factory in factories.items():
                register(name, factory, description=f"the {name} backend")

    return Plugin()


def dynamic_factory(config):
    return DynamicCache(config=config)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("HF_PAGED_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("HF_PAGED_DISABLE_PLUGIN_AUTOLOAD", raising=False)


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Install a fake distribution `fake-plugin 0.1` in tmp_path: `fake_dist(module_name, source)`.

    The entry point is `fake = <module_name>` in group `hf_paged`, found through sys.path like any installed package.
    """
    modules = []

    def install(module_name, source):
        dist_info = tmp_path / "fake_plugin-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 0.1\n")
        (dist_info / "entry_points.txt").write_text(f"[hf_paged]\nfake = {module_name}\n")
        (tmp_path / f"{module_name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates importlib's (and metadata's) path caches
        modules.append(module_name)
        # The loader reads importlib.metadata itself: check the fake distribution is visible to it.
        assert any(ep.value == module_name for ep in importlib.metadata.entry_points(group="hf_paged"))

    yield install
    for name in modules:
        sys.modules.pop(name, None)


GOOD_PLUGIN = """
    from transformers import DynamicCache
    import hf_paged.registry

    def fake_cache(config, *, note=""):
        return DynamicCache(config=config)

    @hf_paged.registry.hookimpl
    def hf_paged_register_backends(register):
        register("fake", fake_cache, description="a third-party backend")
"""

BROKEN_PLUGIN = "import hf_paged_module_that_does_not_exist\n"

DUPLICATE_PLUGIN = """
    import hf_paged.registry

    @hf_paged.registry.hookimpl
    def hf_paged_register_backends(register):
        register("fake-ok", lambda config: None)
        register("paged", lambda config: None)
"""


# ------------------------------------------------------------------------------------------------ built-ins, API
def test_builtins_come_from_entry_points():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="hf_paged")}
    assert names.items() >= {(n, f"hf_paged_plugins.{n}") for n in BUILTINS}, "run pip install -e '.[dev]'"
    registry = BackendRegistry()
    assert set(registry.available_backends()) >= BUILTINS
    for name in BUILTINS:
        backend = registry.get_backend(name)
        assert backend.plugin == name
        assert backend.factory.__module__ == f"hf_paged_plugins.{name}"
        assert registry.plugins[name].startswith(f"entry point {name} = hf_paged_plugins.{name} from hf-paged ")
    assert registry.failed_plugins == {}


def test_builtins_fall_back_to_modules_without_entry_points(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    registry = BackendRegistry()
    assert set(registry.available_backends()) == BUILTINS
    assert registry.plugins["paged"] == "built-in module hf_paged_plugins.paged"


def test_loading_is_lazy(monkeypatch):
    calls = []
    real_entry_points = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: calls.append(kw) or real_entry_points(**kw))
    registry = BackendRegistry()
    assert calls == []
    registry.available_backends()
    registry.get_backend("dynamic")
    assert calls == [{"group": "hf_paged"}]


def test_module_level_api_uses_default_registry():
    assert set(hf_paged.registry.available_backends()) >= BUILTINS
    assert isinstance(hf_paged.registry.create_cache("dynamic", tiny_config()), DynamicCache)


def test_reset_forgets_in_process_plugins():
    registry = BackendRegistry()
    registry.register_plugin(plugin_with(toy=dynamic_factory))
    registry.reset()
    assert set(registry.available_backends()) == BUILTINS


# ----------------------------------------------------------------------------------------- in-process plugins
def test_register_plugin_in_process():
    registry = BackendRegistry()
    plugin_name = registry.register_plugin(plugin_with(toy=dynamic_factory), name="toy-plugin")
    assert plugin_name == "toy-plugin"
    assert registry.available_backends()["toy"] == "the toy backend"
    assert registry.get_backend("toy").plugin == "toy-plugin"
    assert isinstance(registry.create_cache("toy", tiny_config()), DynamicCache)
    assert "toy" not in BackendRegistry().available_backends()  # instances do not share state


def test_register_module_plugin(tmp_path, monkeypatch):
    (tmp_path / "hf_paged_module_plugin.py").write_text(textwrap.dedent(GOOD_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    import hf_paged_module_plugin

    try:
        registry = BackendRegistry()
        registry.register_plugin(hf_paged_module_plugin)
        assert registry.available_backends()["fake"] == "a third-party backend"
        assert registry.get_backend("fake").plugin == "hf_paged_module_plugin"
    finally:
        sys.modules.pop("hf_paged_module_plugin", None)


def test_misspelled_hook_is_rejected():
    class Typo:
        @hookimpl
        def hf_paged_register_backend(self, register):  # missing "s"
            register("typo", dynamic_factory)

    registry = BackendRegistry()
    with pytest.raises(pluggy.PluginValidationError, match="hf_paged_register_backend"):
        registry.register_plugin(Typo())
    assert set(registry.plugins) == BUILTINS  # unregistered again
    assert set(registry.available_backends()) == BUILTINS


def test_factory_must_return_a_cache():
    registry = BackendRegistry()
    registry.register_plugin(plugin_with(bad=lambda config: [], good=dynamic_factory), name="mixed")
    with pytest.raises(TypeError, match=r"backend 'bad' \(plugin 'mixed'\) returned list, not a transformers.Cache"):
        registry.create_cache("bad", tiny_config())


# --------------------------------------------------------------------------------------------------- duplicates
def test_duplicate_in_process_names_both_plugins():
    registry = BackendRegistry()
    with pytest.raises(DuplicateBackend) as info:
        registry.register_plugin(plugin_with(extra=dynamic_factory, dynamic=dynamic_factory), name="copycat")
    message = str(info.value)
    assert "backend 'dynamic' is registered by two plugins" in message
    assert "'dynamic' (entry point dynamic = hf_paged_plugins.dynamic" in message
    assert "'copycat' (registered in-process" in message
    # all or nothing: the plugin is gone, its other backend too, and the built-in still works
    assert "copycat" not in registry.plugins
    assert set(registry.available_backends()) == BUILTINS
    assert registry.get_backend("dynamic").plugin == "dynamic"


def test_duplicate_entry_point_plugin_warns_and_is_skipped(fake_dist):
    fake_dist("fake_duplicate_plugin", DUPLICATE_PLUGIN)
    registry = BackendRegistry()
    with pytest.warns(PluginLoadWarning) as record:
        backends = registry.available_backends()
    assert len(record) == 1
    message = str(record[0].message)
    assert "'fake' (entry point fake = fake_duplicate_plugin from fake-plugin 0.1)" in message
    assert "DuplicateBackend: backend 'paged' is registered by two plugins: 'paged'" in message
    assert set(backends) == BUILTINS  # "fake-ok" went with its plugin
    assert registry.get_backend("paged").plugin == "paged"


def test_duplicate_entry_point_plugin_strict(fake_dist):
    fake_dist("fake_duplicate_plugin", DUPLICATE_PLUGIN)
    with pytest.raises(PluginLoadError, match="backend 'paged' is registered by two plugins") as info:
        BackendRegistry(strict=True).available_backends()
    assert isinstance(info.value.__cause__, DuplicateBackend)


# ---------------------------------------------------------------------------- third-party and broken plugins
def test_fake_distribution_is_discovered(fake_dist):
    fake_dist("fake_good_plugin", GOOD_PLUGIN)
    registry = BackendRegistry()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        assert registry.available_backends()["fake"] == "a third-party backend"
    assert registry.plugins["fake"] == "entry point fake = fake_good_plugin from fake-plugin 0.1"
    assert isinstance(registry.create_cache("fake", tiny_config(), note="x"), DynamicCache)


def test_broken_plugin_warns_once_and_the_rest_works(fake_dist):
    fake_dist("fake_broken_plugin", BROKEN_PLUGIN)
    registry = BackendRegistry()
    with pytest.warns(PluginLoadWarning) as record:
        assert set(registry.available_backends()) == BUILTINS
        registry.create_cache("dynamic", tiny_config())
    assert len(record) == 1
    message = str(record[0].message)
    assert "hf_paged plugin 'fake' (entry point fake = fake_broken_plugin from fake-plugin 0.1)" in message
    assert "ModuleNotFoundError: No module named 'hf_paged_module_that_does_not_exist'" in message
    (error,) = registry.failed_plugins.values()
    assert isinstance(error, ModuleNotFoundError)


def test_broken_plugin_strict_argument(fake_dist):
    fake_dist("fake_broken_plugin", BROKEN_PLUGIN)
    with pytest.raises(PluginLoadError, match="'fake'.*ModuleNotFoundError") as info:
        BackendRegistry(strict=True).available_backends()
    assert isinstance(info.value.__cause__, ModuleNotFoundError)

    # strict at the loader call, after a lenient load: failures are still reported, never hidden
    registry = BackendRegistry()
    with pytest.warns(PluginLoadWarning):
        registry.load_plugins()
    with pytest.raises(PluginLoadError, match="fake_broken_plugin"):
        registry.load_plugins(strict=True)


def test_broken_plugin_strict_env(fake_dist, monkeypatch):
    fake_dist("fake_broken_plugin", BROKEN_PLUGIN)
    monkeypatch.setenv("HF_PAGED_STRICT_PLUGINS", "1")
    registry = BackendRegistry()
    with pytest.raises(PluginLoadError, match="'fake'.*ModuleNotFoundError"):
        registry.available_backends()
    with pytest.raises(PluginLoadError):  # every lookup, not only the first
        registry.get_backend("dynamic")


def test_disable_autoload_skips_third_party_keeps_builtins(fake_dist, monkeypatch):
    fake_dist("fake_good_plugin", GOOD_PLUGIN)
    monkeypatch.setenv("HF_PAGED_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = BackendRegistry()
    assert set(registry.available_backends()) == BUILTINS
    with pytest.raises(UnknownBackend, match="HF_PAGED_DISABLE_PLUGIN_AUTOLOAD"):
        registry.get_backend("fake")
    assert "fake_good_plugin" not in sys.modules  # not even imported
    assert "fake" in BackendRegistry(autoload=True).available_backends()  # the argument wins over the env var


# ------------------------------------------------------------------------------------------------ error messages
def test_unknown_backend_lists_available_and_failed(fake_dist):
    fake_dist("fake_broken_plugin", BROKEN_PLUGIN)
    registry = BackendRegistry()
    with pytest.warns(PluginLoadWarning):
        with pytest.raises(UnknownBackend) as info:
            registry.create_cache("pagd", tiny_config())
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert message.startswith("unknown cache backend 'pagd'; available: dynamic, paged, static;")
    assert "plugins that failed to load: 'fake' (entry point fake = fake_broken_plugin" in message
    assert "ModuleNotFoundError" in message


def test_unknown_option_lists_accepted_ones():
    registry = BackendRegistry()
    config = tiny_config()
    with pytest.raises(BackendOptionError, match=r"'static' does not accept option\(s\) block_size; it accepts: "
                       r"max_cache_len$"):  # fmt: skip
        registry.create_cache("static", config, max_cache_len=8, block_size=4)
    with pytest.raises(TypeError, match=r"'dynamic' does not accept option\(s\) max_cache_len; it accepts: \(no "):
        registry.create_cache("dynamic", config, max_cache_len=8)
    with pytest.raises(TypeError, match="it accepts: pool, block_size, dtype, device, share_rows"):
        registry.create_cache("paged", config, num_blocks=8)


def test_missing_required_option():
    with pytest.raises(BackendOptionError, match=r"'static' needs option\(s\) max_cache_len, e.g. create_cache"):
        BackendRegistry().create_cache("static", tiny_config())
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        BackendRegistry().create_cache("static", tiny_config(), max_cache_len=0)


def test_create_cache_rejects_non_models():
    with pytest.raises(TypeError, match="needs a transformers model or config, got str"):
        BackendRegistry().create_cache("dynamic", "meta-llama/Llama-3.2-1B")


# ---------------------------------------------------------------------------------------- config and model hints
def test_factory_gets_text_config_and_model_hints_when_accepted():
    seen = {}

    def with_hints(config, *, dtype=None, device=None):
        seen.update(config=config, dtype=dtype, device=device)
        return DynamicCache(config=config)

    def without_hints(config, **options):  # **options does not opt into the hints
        seen.update(config=config, options=options)
        return DynamicCache(config=config)

    registry = BackendRegistry()
    registry.register_plugin(plugin_with(hints=with_hints, plain=without_hints))
    model = LlamaForCausalLM(tiny_config()).to(torch.bfloat16)

    registry.create_cache("hints", model)
    assert seen == {"config": model.config.get_text_config(decoder=True), "dtype": torch.bfloat16,
                    "device": torch.device("cpu")}  # fmt: skip
    registry.create_cache("hints", model, dtype=torch.float16)  # explicit options win
    assert seen["dtype"] == torch.float16
    registry.create_cache("hints", model.config)  # a bare config gives no hints
    assert seen["dtype"] is None and seen["device"] is None
    registry.create_cache("plain", model, anything=1)
    assert seen["options"] == {"anything": 1}


def test_errors_have_readable_str():
    error = UnknownBackend("unknown cache backend 'x'; available: dynamic")
    assert str(error) == "unknown cache backend 'x'; available: dynamic"
    assert issubclass(BackendOptionError, TypeError) and issubclass(DuplicateBackend, ValueError)
