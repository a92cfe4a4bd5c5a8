"""How a request names its adapter (:class:`AdapterRef`), and the error when no adapter answers to it
(:class:`UnknownAdapterError`); :meth:`mmlora.lora.manager.LoRAManager.resolve` resolves one."""

from __future__ import annotations

from dataclasses import dataclass


class UnknownAdapterError(LookupError, ValueError):
    """A request named an adapter that is neither registered nor a folder it may load, or one being
    unloaded (which answers as if it were already gone: 404)."""

    def __init__(
        self, param: str, key: str, registered: list[str], reason: str = "not a registered name nor a folder"
    ) -> None:
        known = ", ".join(registered) or "none"
        super().__init__(f"{param}: unknown adapter {key!r} ({reason}); registered: {known}")
        self.param, self.key, self.registered = param, key, registered


@dataclass(frozen=True)
class AdapterRef:
    """A request's adapter as its client named it; :meth:`LoRAManager.resolve` resolves it once, on the
    engine thread, when the request is added (a plain string is ``AdapterRef(key)``).

    key             a registered name, a registered path, or a folder to load on first use
    param           the request field that named it (errors name it)
    allow_folders   whether an unregistered folder may be loaded (the server: only with run-time updates)
    lora_root       when set (the server), unregistered folders must name a path confined to it
                    (:func:`mmlora.lora.paths.confine_adapter_path`; ``confine`` without a root refuses)
    confine         whether ``lora_root`` applies (True for anything that arrives over the network)
    same_as         (param, key) of a second field that must name the same adapter (OpenAI ``model``
                    next to the ``lora_path`` extra)
    """

    key: str
    param: str = "lora_path"
    allow_folders: bool = True
    confine: bool = False
    lora_root: str | None = None
    same_as: tuple[str, str] | None = None
