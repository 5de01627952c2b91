import os

# One intra-op thread per test process (and, through the environment, per subprocess it starts): the tests' tensors are
# tiny, and scripts/test.sh runs two pytest-xdist workers on two cores, where torch's default (a thread per core in
# each process) oversubscribes the cores. Measured on tests/backends/test_kl_placement.py: 26 % less CPU time.
# Set before torch is imported; OMP_NUM_THREADS given by the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (torch does not import triton)

if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# TRL's fused log-prob kernel is Triton; on a machine with no GPU it only runs interpreted.
# This must be set before triton is first imported, and never on a GPU machine, where every
# Triton kernel (Unsloth's, Liger's, TRL's) would then run through the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tokenizer and a tiny Llama, built here and saved (TRL loads the reference model by path)."""
    import toy

    return toy.build_checkpoint(str(tmp_path_factory.mktemp("tiny")), hidden_size=32, layers=2)


# tests/reference.py is imported by name from every test folder (and by subprocess workers).
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

# Triton's interpreter without its per-call walk of triton.language (tests/_triton_interpreter.py: the same kernels,
# the same results; tests/test_triton_interpreter.py checks both), in the test processes when no GPU is present.
if os.environ.get("TRITON_INTERPRET") == "1":
    import _triton_interpreter  # noqa: E402

    _triton_interpreter.install()

# The offline task, examples/toy.py (no part of the package since issue 54), is imported as ``toy`` by the tests, and
# by the scripts and workers they start in subprocesses: examples/ goes on sys.path here and on their PYTHONPATH.
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(capability, arch_list)``: torch.cuda reports one GPU, "Test GPU", of that compute
    capability, and a torch build with that arch list (for doctor's GPU check without a GPU)."""

    def install(capability, arch_list):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Test GPU")
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch_list)

    return install


@pytest.fixture
def half_kl():
    """``half_kl``, a shaping method registered as a user would (from outside the package), removed after."""
    import unsloth_adaptive_kl

    @unsloth_adaptive_kl.register_shaping("half_kl")
    def half_kl(kl):
        return 0.5 * kl

    yield "half_kl"
    unsloth_adaptive_kl.unregister_shaping("half_kl")


@pytest.fixture
def user_shaping():
    """``user_shaping(name, fn, **register_kwargs)`` registers ``fn`` as a user would (returns ``name``); all are
    removed after the test."""
    import unsloth_adaptive_kl

    names = []

    def register(name, fn, **kwargs):
        unsloth_adaptive_kl.register_shaping(name, **kwargs)(fn)
        names.append(name)
        return name

    yield register
    for name in names:
        unsloth_adaptive_kl.unregister_shaping(name)


# `import unsloth` rebinds TRL's classes for the rest of the process, so the tests import it only in subprocesses
# (tests/backends/*_worker.py). A test module or test that imports it in a test process would change every later test
# on that worker, which then fails far from the cause (seen in CI on 2026-11-29: a module-level
# pytest.importorskip("unsloth") made five TRL tests log "unsloth is imported"). Named here instead, where it happens.
_UNSLOTH_FIRST_SEEN: list[str] = []


def pytest_collectreport(report):
    if "unsloth" in sys.modules and not _UNSLOTH_FIRST_SEEN:
        _UNSLOTH_FIRST_SEEN.append(report.nodeid or "the test session's start")


def pytest_collection_finish(session):
    if _UNSLOTH_FIRST_SEEN:
        raise pytest.UsageError(f"`import unsloth` ran in the test process while collecting {_UNSLOTH_FIRST_SEEN[0]!r}: it "
                                "rebinds TRL's classes for every later test; import it in a subprocess (tests/backends/*_worker.py)")


@pytest.fixture(autouse=True)
def _unsloth_stays_out_of_the_test_process(request):
    before = "unsloth" in sys.modules
    yield
    if not before and "unsloth" in sys.modules:
        pytest.fail(f"{request.node.nodeid} imported unsloth in the test process: it rebinds TRL's classes for every later "
                    "test; import it in a subprocess (tests/backends/*_worker.py)", pytrace=False)
