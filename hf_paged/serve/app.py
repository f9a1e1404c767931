"""The FastAPI app of `hf-paged serve`: transformers' server (`build_server`) and handlers, with the Engine behind
them, `/metrics`, OpenAI-style error bodies, and disconnects that abort their requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..engine import Engine
from ..engine.warm_up import warm_up
from ..errors import InvalidRequest
from ..storage import BlockPool
from .limits import RequestLimits
from .manager import EngineManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """What `hf-paged serve` runs (its command-line flags)."""

    model: str  # a local directory with the model and its tokenizer
    host: str = "127.0.0.1"
    port: int = 8000
    max_memory: str = "1GiB"  # the KV cache pool's budget
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    dtype: str = "auto"
    device: str = "cpu"
    # How far admission looks ahead: a request without max_tokens may run to the model's position limit, and
    # reserving all of it would admit few; past this many tokens a request that outgrows the pool is preempted.
    decode_reserve_tokens: int | None = 256
    api_key: str | None = None  # requests without "Authorization: Bearer <api_key>" get 401
    served_model_name: str | None = None  # the name clients ask for (default: the `model` directory as given)
    max_model_len: int | None = None  # the most tokens of one request, prompt and generated (default: the model's)
    # torch.compile the Engine's forwards (CUDA only): decode steps 2.46 ms instead of 4.14 and steps that prefill
    # 24.9 ms instead of 32.8 on an H200 with a Llama-3.2-1B shape, after 46.5 s of compiling at startup
    compile: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def error_body(message: str, status_code: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def build_app(config: ServeConfig):
    """Load the model, build its pool and Engine, and return `(app, manager)`; the caller runs the app."""
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler

    from .disconnect import DisconnectGuard
    from .fields import unapplied_generation_settings
    from .handlers import PagedChatCompletionHandler, PagedCompletionHandler, PagedResponseHandler
    from .state import PagedGenerationState

    model_manager = ModelManager(device=config.device, dtype=config.dtype, force_model=config.model)
    model, _processor = model_manager.load_model_and_processor(model_manager.process_model_name(config.model))
    unapplied = unapplied_generation_settings(model.generation_config)
    if unapplied:
        settings = ", ".join(f"{key}={value!r}" for key, value in unapplied.items())
        logger.warning("the model's generation config sets %s, which hf-paged serve does not apply", settings)
    pool = BlockPool.for_model(
        model, max_memory=config.max_memory, block_size=config.block_size, enable_prefix_caching=True
    )
    engine = Engine(
        model,
        pool,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=True,
        decode_reserve_tokens=config.decode_reserve_tokens,
        compile_decode=config.compile,
        compile_prefill=config.compile,
    )
    if pool.device.type == "cuda":  # kernels, CUDA graphs and compiled forwards made now, not in the first requests
        warm_up(engine)
    manager = EngineManager(engine, RequestLimits.for_engine(engine, config.max_model_len))
    state = PagedGenerationState(manager)
    handlers = {"model_manager": model_manager, "generation_state": state}
    paged = {**handlers, "served_model_name": config.model_name}
    app = build_server(
        model_manager,
        PagedChatCompletionHandler(**paged),
        completion_handler=PagedCompletionHandler(**paged),
        response_handler=PagedResponseHandler(**paged),
        transcription_handler=TranscriptionHandler(model_manager, state),
        systemone_handler=SystemOneHandler(**handlers),
        generation_state=state,
    )
    _pin_model(app, config)
    _add_routes_and_checks(app, config, manager)
    _answer_errors_as_openai(app)
    app.add_middleware(DisconnectGuard)
    return app, manager


def _pin_model(app, config: ServeConfig) -> None:
    """The server serves the one model it was started with: no endpoint loads another (or fetches one from a hub),
    and `/v1/models` lists that one by the name clients use (transformers' lists a hub cache)."""
    from fastapi.responses import JSONResponse

    pinned = ("/load_model", "/reset", "/v1/audio/transcriptions")
    replaced = (*pinned, "/v1/models")
    app.router.routes[:] = [route for route in app.router.routes if getattr(route, "path", None) not in replaced]

    @app.get("/v1/models")
    def list_models():
        return JSONResponse(
            {"object": "list", "data": [{"id": config.model_name, "object": "model", "owned_by": "hf-paged"}]}
        )

    @app.post("/load_model")
    @app.post("/reset")
    @app.post("/v1/audio/transcriptions")  # it would load any model it is asked for
    def refuse_model_change():
        message = f"hf-paged serve serves {config.model}, a text model, only; start another server for another model"
        return JSONResponse(error_body(message, 400), status_code=400)


def _add_routes_and_checks(app, config: ServeConfig, manager: EngineManager) -> None:
    """Prometheus `/metrics`, and the API key check of `--api-key` on every `/v1/` route."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    from . import metrics

    if config.api_key is not None:

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            if (
                request.url.path.startswith("/v1/")
                and request.headers.get("authorization") != f"Bearer {config.api_key}"
            ):
                body = error_body("a valid API key is needed: Authorization: Bearer <key>", 401)
                return JSONResponse(body, status_code=401)
            return await call_next(request)

    @app.get("/metrics")
    def prometheus_metrics():
        return Response(metrics.render(manager.metrics), media_type=metrics.CONTENT_TYPE)


def _answer_errors_as_openai(app) -> None:
    """Every error as an OpenAI-style body (`error_body`): a refused request 400 naming its field, HTTP and
    validation errors with their status, 503 once the Engine thread has stopped, 500 (logged) for anything else."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException
    from transformers.cli.serving.utils import CBWorkerDeadError

    @app.exception_handler(InvalidRequest)
    async def invalid_request(_request: Request, error: InvalidRequest):
        body = error_body(error.message, error.status_code, error.param, error.code)
        return JSONResponse(body, status_code=error.status_code)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail), error.status_code), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError):
        return JSONResponse(error_body(f"invalid request body: {error.errors()}", 400), status_code=400)

    @app.exception_handler(CBWorkerDeadError)
    async def engine_stopped(_request: Request, error: CBWorkerDeadError):
        return JSONResponse(error_body(str(error), 503), status_code=503)

    @app.exception_handler(Exception)
    async def server_error(_request: Request, error: Exception):
        logger.exception("request failed")
        return JSONResponse(error_body(f"the server failed: {error!r}", 500), status_code=500)
