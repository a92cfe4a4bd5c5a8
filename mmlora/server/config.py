"""Server options: one frozen dataclass; its command-line flags are generated like the engine's."""

from __future__ import annotations

from dataclasses import dataclass

from mmlora.config import _f


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f(
        "127.0.0.1", "Address to bind; loopback unless told otherwise (0.0.0.0 exposes the server)."
    )
    port: int = _f(30000, "TCP port to listen on.")
    api_key: str | None = _f(
        None, "If set, every endpoint requires the header 'Authorization: Bearer <key>'."
    )
    enable_lora_runtime_update: bool = _f(
        False, "Allow POST /load_lora_adapter and /unload_lora_adapter (needs --lora-root)."
    )
    lora_root: str | None = _f(
        None, "Folder that adapters loaded at run time must lie in (checked on resolved real paths)."
    )
    allowed_local_media_path: str | None = _f(
        None,
        "Folder that images given as local file paths or file:// URLs must lie in; none allowed if unset.",
    )
    allow_remote_media: bool = _f(False, "Fetch http(s) image URLs (off: such URLs are refused).")
    max_in_flight_requests: int | None = _f(
        None,
        "Requests accepted and not yet finished beyond which new ones get 429; "
        "defaults to max_running_requests + max_queued_requests.",
    )
    max_request_bytes: int = _f(
        16 * 1024 * 1024, "Largest request body in bytes; a larger one is answered 413 before it is parsed."
    )
    max_images_per_request: int = _f(16, "Most images one request may carry.")
    max_image_pixels: int = _f(
        4096 * 4096, "Most pixels (width x height) of one image, checked on its header before decoding."
    )
    preprocess_workers: int = _f(
        2, "Threads that tokenize prompts and decode images, off the engine thread and the event loop."
    )
    health_timeout: float = _f(
        60.0, "Seconds /health waits for its one-token generation before answering 503."
    )
    drain_timeout: float = _f(
        600.0, "On SIGTERM: seconds to let in-flight requests finish before aborting them."
    )
    max_adapter_metric_labels: int = _f(
        16, "Adapters named in the residency metrics (the busiest); the rest are counted as 'other'."
    )
    log_level: str = _f("info", "Log level of the server and uvicorn: debug, info, warning, error.")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if self.enable_lora_runtime_update and not self.lora_root:
            raise ValueError(
                "enable_lora_runtime_update: also give --lora-root, the folder that run-time adapters must lie in"
            )
        if self.max_in_flight_requests is not None and self.max_in_flight_requests < 1:
            raise ValueError("max_in_flight_requests: must be >= 1")
        for name in ("max_request_bytes", "max_images_per_request", "max_image_pixels", "preprocess_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.health_timeout <= 0:
            raise ValueError("health_timeout: must be > 0")
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"log_level: unknown level {self.log_level!r}")
        if self.max_adapter_metric_labels < 0:
            raise ValueError("max_adapter_metric_labels: must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty")
