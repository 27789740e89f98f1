# ============================================================================
# Model files and tokenizer (loader / tokenizer / detokenizer helper). Keep this block first.
# ============================================================================
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")           # tests never touch the hub
# engines run eagerly unless a test asks for compiled decode steps (tests/test_compiled_decode.py): background
# compiles in every engine of the suite would take the CI machine's two cores from the tests
os.environ.setdefault("KVFLOW_ENFORCE_EAGER", "1")
sys.path.insert(0, str(Path(__file__).parent))          # `from tiny_models import ...`


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF."""
    from kvflow.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from kvflow.tokenizer import Tokenizer

    return Tokenizer.from_model(smollm2_path)

# ============================================================================
# End of the loader / tokenizer block.
# ============================================================================


# ---- engine fixtures (shared by engine, server and benchmark tests) --------------------------------

@pytest.fixture(scope="session")
def smol_llm():
    """The embedded SmolLM2 in float32: the reference-exact configuration."""
    from kvflow import LLM
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory="256MiB")


@pytest.fixture(scope="session")
def hf_smol():
    """Hugging Face transformers' own load of the embedded GGUF (dequantized, float32): ~20 s, once."""
    import torch
    from transformers import AutoModelForCausalLM
    from kvflow.models.loader import default_model_path
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()     # beside the engine's device
