"""Hub ids: download (or find in the local cache) the files a model needs."""
from __future__ import annotations

import os

from .errors import ModelSourceError

ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json",
]


def download(repo_id: str, *, revision: str | None = None, download_dir: str | None = None) -> str:
    """Local snapshot folder for `repo_id`; ModelSourceError with advice when it cannot be had."""
    try:
        from huggingface_hub import errors as hf_errors
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelSourceError("huggingface_hub is not installed; pass a local model path instead.") from None

    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    local_hint = "or pass a local folder / .gguf file instead"
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=ALLOW_PATTERNS)
    except hf_errors.HFValidationError:
        raise ModelSourceError(
            f"{repo_id!r} is neither an existing local path nor a valid hub id (like 'org/name'); "
            "check the spelling.") from None
    except hf_errors.GatedRepoError:
        raise ModelSourceError(
            f"model {where} is gated: accept its licence on the hub and set HF_TOKEN to a token "
            f"with access, {local_hint}.") from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelSourceError(
            f"model {where} was not found on the hub: check the id, set HF_TOKEN if it is private, "
            f"{local_hint}.") from None
    except hf_errors.RevisionNotFoundError:
        raise ModelSourceError(f"revision {revision!r} of {repo_id!r} does not exist; check --revision.") from None
    except hf_errors.LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = "offline mode (HF_HUB_OFFLINE) is on" if offline else "the hub could not be reached"
        raise ModelSourceError(
            f"model {where} is not in the local cache and {why}: check the id, connect to the "
            f"network (unset HF_HUB_OFFLINE) or set HF_TOKEN, {local_hint}.") from None
    except hf_errors.HfHubHTTPError as e:
        raise ModelSourceError(
            f"downloading {where} failed ({e}); check the id and your network, set HF_TOKEN if the "
            f"model is private, {local_hint}.") from None
    except (OSError, ValueError) as e:
        raise ModelSourceError(
            f"downloading {where} failed ({type(e).__name__}: {e}); check the id and your network, "
            f"{local_hint}.") from None
