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
# under pytest-xdist two workers share the cores: an OpenMP thread that spins at a barrier while the other worker
# computes takes its core for nothing (a torch-heavy test ran 8x slower beside one busy process, 1.6x with this).
# Read when torch loads, after this; engine processes and other children inherit it.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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


# ---- the machine shared by pytest-xdist's workers --------------------------------------------------------------
# The suite runs on two workers (pyproject's addopts: most tests leave a core idle while they wait on a server,
# a subprocess or one Python thread). A test marked `alone` asserts timing or how the engine shares the cores, so
# no other test may run beside it: it takes the machine lock exclusively, every other test shares it. A waiting
# `alone` test holds the turnstile, so the other worker's next tests queue behind it instead of starving it.
@pytest.fixture(autouse=True)
def _machine_lock(request, tmp_path_factory):
    if "PYTEST_XDIST_WORKER" not in os.environ:        # one process: nothing runs beside anything
        yield
        return
    import fcntl

    folder = tmp_path_factory.getbasetemp().parent          # one folder for all the run's workers
    alone = request.node.get_closest_marker("alone") is not None
    with open(folder / "machine.lock", "a") as machine, open(folder / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: two workers where two cores are free to this process (what the suite is measured on), one on a
    single core. More would multiply the engines that compete for the same cores and memory."""
    return min(2, len(os.sched_getaffinity(0)))
