"""The CUDA backend: registration, probes with and without hardware, interpreter mode, the engine
end to end in the interpreter, the conformance core tier, and the GPU check's CPU-runnable parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from plinth_cuda import CudaBackend, backend, plugin
from plinth_triton import runtime
from plinth_triton.backend import INTERPRETER_DEVICE, INTERPRETER_SCORE, GpuServices, InterpreterServices

from plinth.platform.backend import AttentionSpec, NotSupported

ROOT = Path(__file__).parents[3]
PLINTH = Path(sys.executable).parent / "plinth"


@pytest.fixture
def hardware_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """No interpreter request in the environment."""
    monkeypatch.delenv(runtime.INTERPRET_ENV, raising=False)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] = (9, 0)) -> None:
    """A CUDA build of torch that sees one H100 (nothing is launched)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (70 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: capability >= (8, 0))


def test_entry_point_and_registration() -> None:
    """``cuda = plinth_cuda.plugin`` in the plinth.backends group; the hook returns one CudaBackend."""
    pyproject = tomllib.loads((ROOT / "plugins/cuda/pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["plinth.backends"] == {"cuda": "plinth_cuda.plugin"}
    assert "plinth-triton-kernels>=0.1" in pyproject["project"]["dependencies"]
    assert any(ep.name == "cuda" for ep in entry_points(group="plinth.backends"))
    (cuda,) = plugin.plinth_register_backends()
    assert isinstance(cuda, CudaBackend) and cuda.communicator == "nccl" and cuda.api_version == (1, 13)


def test_plugin_import_does_not_import_triton() -> None:
    """Loading the plugin must work without triton: kernels are imported once selected."""
    code = "import sys, plinth_cuda.plugin, plinth_rocm.plugin; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ""}).returncode == 0


@pytest.mark.usefixtures("hardware_mode")
def test_probe_without_cuda_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU build of torch: score 0, and the reason names the torch build."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    probe = CudaBackend().probe()
    assert probe.score == 0 and probe.reasons == (f"torch {torch.__version__} has no CUDA support",)
    monkeypatch.setattr(torch.version, "hip", "6.3")
    assert "use the rocm backend" in CudaBackend().probe().reasons[0]


@pytest.mark.usefixtures("hardware_mode")
def test_probe_without_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build of torch but no visible GPU: score 0, "no CUDA device visible"."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    probe = CudaBackend().probe()
    assert probe.score == 0 and probe.reasons[0].startswith("no CUDA device visible")


@pytest.mark.usefixtures("hardware_mode")
def test_probe_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A (simulated) H100: full score, device name, capability, memory, triton version; not emulation."""
    _fake_gpu(monkeypatch)
    probe = CudaBackend().probe()
    assert probe.score == backend.HARDWARE_SCORE and not probe.emulation
    assert probe.device_name == "NVIDIA H100 80GB HBM3"
    text = "; ".join(probe.reasons)
    assert "compute capability 9.0" in text and "70.0 GiB free of 80.0 GiB" in text and "triton" in text
    assert CudaBackend().arch() == "sm90"
    caps = CudaBackend().capabilities()
    assert "cuda_graphs" in caps.features  # declared on hardware only
    services = CudaBackend().device_services()
    assert isinstance(services, GpuServices) and services.default_dtype() == "bfloat16"
    assert services.device == torch.device("cuda", 0) and services.memory_info() == (70 << 30, 80 << 30)


@pytest.mark.usefixtures("hardware_mode")
def test_probe_old_gpu_and_missing_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """sm75: usable in fp16 with a lower score; sm60: 0; no triton: 0 with the reason."""
    _fake_gpu(monkeypatch, (7, 5))
    assert CudaBackend().probe().score == backend.NO_BF16_SCORE
    assert CudaBackend().device_services().default_dtype() == "float16"
    _fake_gpu(monkeypatch, (6, 0))
    assert CudaBackend().probe().score == 0
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(runtime, "triton_status", lambda: runtime.TritonStatus(False, "triton is not importable (x)"))
    probe = CudaBackend().probe()
    assert probe.score == 0 and "triton is not importable" in probe.reasons[-1]


def test_interpreter_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """PLINTH_TRITON_INTERPRET=1: emulation, the interpreter as device, a score below cpu's 50."""
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the probe sets it to 1: restored after the test
    monkeypatch.setattr(runtime, "triton_status", lambda: runtime.TritonStatus(True, "triton 9.9"))
    probe = CudaBackend().probe()
    assert probe.score == INTERPRETER_SCORE and 0 < probe.score < 50
    assert probe.emulation and probe.device_name == INTERPRETER_DEVICE
    assert os.environ["TRITON_INTERPRET"] == "1"
    b = CudaBackend()
    assert isinstance(b.device_services(), InterpreterServices)
    assert b.device_services().default_dtype() == "float32" and b.device_services().device.type == "cpu"
    assert "cuda_graphs" not in b.capabilities().features
    monkeypatch.setattr(runtime, "triton_status", lambda: runtime.TritonStatus(False, "triton is not importable"))
    probe = CudaBackend().probe()
    assert probe.score == 0 and "triton is not importable" in probe.reasons[0]


def test_undeclared_cases_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undeclared head size / block size / dtype raise NotSupported with the reason."""
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the probe sets it to 1: restored after the test
    b = CudaBackend()
    with pytest.raises(NotSupported, match="head size 48"):
        b.attention_kernels(AttentionSpec(4, 2, 48, 16))
    with pytest.raises(NotSupported, match="block size 8"):
        b.attention_kernels(AttentionSpec(4, 2, 64, 8))
    with pytest.raises(NotSupported, match="float64"):
        b.gemm_kernels("float64")


def test_plinth_backends_lists_cuda_unusable() -> None:
    """`plinth backends` on this CPU-only machine: cuda and rocm listed with score 0 and the reason."""
    env = {k: v for k, v in os.environ.items() if k not in (runtime.INTERPRET_ENV, "TRITON_INTERPRET")}
    result = subprocess.run([str(PLINTH), "backends"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0].lstrip("*"): line for line in result.stdout.splitlines() if line.strip()}
    for name, reason in (("cuda", "has no CUDA support"), ("rocm", "has no ROCm (HIP) support")):
        fields = rows[name].split()
        assert fields[1] == "0", rows[name]
        assert reason in rows[name] or "no device visible" in rows[name], rows[name]


@pytest.mark.triton_interpret
def test_engine_greedy_equals_reference(tmp_path: Path) -> None:
    """LLM(backend="cuda") in the interpreter: the reference backend's greedy tokens on a tiny Llama.

    A tiny random model tends to repeat one token, so each step's generated-token logprob is
    compared too: that checks every decode step's numerics, not only the argmax.
    """
    sys.path.insert(0, str(ROOT / "tests/core/runtime/engine"))
    from engine_helpers import save_tiny_folder

    from plinth import LLM, SamplingParams

    save_tiny_folder("llama", tmp_path)
    prompts = ["The capital of France is", "def fibonacci(n):\n    if n < 2: return n\n   "]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    tokens, logprobs = {}, {}
    for name in ("reference", "cuda"):
        llm = LLM(model=str(tmp_path), backend=name, max_model_len=64, num_kv_blocks=16)
        assert llm.engine.backend.name == name
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        tokens[name] = [list(o.token_ids) for o in outs]
        logprobs[name] = torch.tensor([[lp.logprob for lp in o.logprobs or []] for o in outs])
    assert tokens["cuda"] == tokens["reference"]
    assert logprobs["cuda"].shape == (2, 8)
    torch.testing.assert_close(logprobs["cuda"], logprobs["reference"], rtol=1e-4, atol=1e-4)


@pytest.mark.triton_interpret
def test_conformance_core_tier(tmp_path: Path) -> None:
    """`plinth conformance --backend cuda --tier core` passes in the interpreter; the certificate
    says interpreter/emulation, never hardware."""
    env = {**os.environ, runtime.INTERPRET_ENV: "1", "TRITON_INTERPRET": "1"}
    cmd = [str(PLINTH), "conformance", "--backend", "cuda", "--tier", "core", "--report", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cert = json.loads((tmp_path / "certificate.json").read_text())
    text = json.dumps(cert)
    assert "interpreter" in text and cert["backend"]["name"] == "cuda"
    assert '"verified_on": "hardware' not in text


@pytest.mark.triton_interpret
def test_perfcheck_runs_on_tiny_shapes(tmp_path: Path) -> None:
    """The GPU check's perf report and e2e comparison, on tiny shapes in the interpreter."""
    from plinth_cuda import perfcheck

    out = tmp_path / "gpu-perf.md"
    assert perfcheck.main(["perf", "--backend", "cuda", "--tiny", "--out", str(out)]) == 0
    report = out.read_text()
    assert "## Decode attention at long context" in report and "| qkv | 3 | 64 | 32 |" in report
    assert "emulation: True" in report
    ok, message = perfcheck.e2e_check("cuda", max_tokens=4)
    assert ok, message


@pytest.mark.usefixtures("hardware_mode")
def test_each_rank_binds_its_own_gpu_and_the_collectives_are_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plugin API 1.13: local rank r drives GPU r (torch.cuda.set_device, services made for it); a
    rank without a GPU is refused naming how many there are. Nothing is launched."""
    _fake_gpu(monkeypatch)
    current = [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: current.__setitem__(0, int(i)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    cuda = CudaBackend()
    assert cuda.device_services().device == torch.device("cuda", 0)
    cuda.bind_local_rank(1)
    services = cuda.device_services()
    assert current == [1] and services.device == torch.device("cuda", 1)
    assert services.device_for_rank(1) == services.device  # what the core checks after the bind
    assert cuda.capabilities().communicator == "nccl"
    assert cuda.capabilities().device_resource == "GPU"  # what the Ray executor reserves per rank
    with pytest.raises(ValueError, match=r"local rank 2 needs GPU 2; CUDA sees 2 GPU\(s\)"):
        cuda.bind_local_rank(2)


def test_in_the_interpreter_every_rank_stays_on_the_cpu_with_the_host_collectives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the mode sets it to 1: restored after the test
    cuda = CudaBackend()
    cuda.bind_local_rank(3)
    services = cuda.device_services()
    assert services.device == torch.device("cpu") and services.device_for_rank(3) == services.device
    assert cuda.capabilities().communicator is None and cuda.capabilities().device_resource is None
