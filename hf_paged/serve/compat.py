"""The transformers serving seams `hf-paged serve` plugs into, checked once at startup.

transformers has no extension point for its server's generation backend: the server builds a `GenerationState`
whose `get_manager()` hands each request handler a `BaseGenerateManager`. `hf-paged serve` builds the same app from
the same parts with its own state and manager, so it depends on those parts' names and signatures. `check_seams`
verifies each of them exists before anything is loaded: a transformers whose serving code differs fails at startup
with the supported range, never mid-request.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

from ..errors import ServeUnavailable

# The transformers releases whose serving code these seams were read from.
SUPPORTED_TRANSFORMERS = ">=5.23,<5.25"
SERVING_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic", "starlette")

# module -> {attribute: members it must have}
SEAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "transformers.cli.serving.utils": {
        "BaseGenerateManager": ("init_cb", "generate_streaming", "generate_non_streaming", "stop"),
        "GenerationState": ("get_manager", "use_continuous_batching", "is_cb_alive", "shutdown"),
        "BaseHandler": ("_build_generation_config", "_validate_request", "_resolve_model"),
        "CBWorkerDeadError": (),
        "_StreamError": (),
        "response_events_to_chunks": (),
        "get_response_template": (),
    },
    "transformers.cli.serving.server": {"build_server": ()},
    "transformers.cli.serving.model_manager": {"ModelManager": ("load_model_and_processor", "process_model_name")},
    "transformers.cli.serving.chat_completion": {"ChatCompletionHandler": ("handle_request",)},
    "transformers.cli.serving.completion": {"CompletionHandler": ("handle_request",)},
    "transformers.cli.serving.response": {"ResponseHandler": ("handle_request",)},
    "transformers.cli.serving.transcription": {"TranscriptionHandler": ("handle_request",)},
    "transformers.cli.serving.systemone": {"SystemOneHandler": ("handle_request",)},
}
# function -> the parameters it is called with
SIGNATURES: dict[tuple[str, str, str | None], tuple[str, ...]] = {
    ("transformers.cli.serving.server", "build_server", None): (
        "model_manager",
        "chat_handler",
        "completion_handler",
        "response_handler",
        "transcription_handler",
        "systemone_handler",
        "generation_state",
    ),
    ("transformers.cli.serving.utils", "BaseGenerateManager", "generate_streaming"): (
        "model",
        "processor",
        "inputs",
        "gen_config",
        "request_id",
        "response_parser",
    ),
    ("transformers.cli.serving.utils", "BaseGenerateManager", "generate_non_streaming"): (
        "model",
        "processor",
        "inputs",
        "gen_config",
        "request_id",
    ),
    ("transformers.cli.serving.utils", "BaseHandler", "_build_generation_config"): (
        "body",
        "model_generation_config",
        "use_cb",
    ),
    ("transformers.cli.serving.model_manager", "ModelManager", "__init__"): ("device", "dtype", "force_model"),
}


def check_seams() -> None:
    """Raise `ServeUnavailable` naming what is missing: a serving package, or a transformers seam (with the
    supported transformers range)."""
    import transformers

    missing_packages = [name for name in SERVING_PACKAGES if importlib.util.find_spec(name) is None]
    if missing_packages:
        raise ServeUnavailable(f"hf-paged serve needs {', '.join(missing_packages)}: pip install 'hf-paged[serve]'")
    missing: list[str] = []
    for module_name, attributes in SEAMS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            missing.append(f"{module_name} ({error})")
            continue
        for attribute, members in attributes.items():
            owner = getattr(module, attribute, None)
            if owner is None:
                missing.append(f"{module_name}.{attribute}")
                continue
            missing += [f"{module_name}.{attribute}.{m}" for m in members if not hasattr(owner, m)]
    for (module_name, attribute, member), parameters in SIGNATURES.items():
        try:
            function = getattr(importlib.import_module(module_name), attribute)
            function = getattr(function, member) if member else function
            names = inspect.signature(function).parameters
        except (ImportError, AttributeError, TypeError, ValueError):
            continue  # already reported above
        where = ".".join(part for part in (module_name, attribute, member) if part)
        missing += [f"parameter {name!r} of {where}" for name in parameters if name not in names]
    if missing:
        raise ServeUnavailable(
            f"hf-paged serve plugs into transformers' serving code as it is in transformers{SUPPORTED_TRANSFORMERS}; "
            f"transformers {transformers.__version__} lacks {', '.join(missing)}. Install "
            f"'transformers{SUPPORTED_TRANSFORMERS}'"
        )
