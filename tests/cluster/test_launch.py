"""`ray job submit` against a real `ray start --head` on 127.0.0.1: the cluster launcher serves the
CPU example spec (1 prefill + 1 decode replica of the embedded model), answers a completion through
the official `openai` client, and stops with the job. Its Serve proxy reaches the ingress over Ray's
calls (`serving.proxy_channel: ray`; the cluster started without RAY_SERVE_PROXY_USE_GRPC=1, which
the launch warns of), the one test that runs that channel.

Ray (2.59+) turns token authentication on for clusters it starts, but a client whose RAY_AUTH_MODE
is unset sends no token, so `ray job submit` is refused after a local ray.init() or `ray start`
made a token file. The fix is to run the CLI and the cluster in the same mode: here, a token
(`ray get-auth-token --generate` makes ~/.ray/auth_token if none exists) and RAY_AUTH_MODE=token
for both."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import openai
import pytest
from helpers import REPO, free_port, kill_ray_processes, make_adapter, wait_healthy

ray = pytest.importorskip("ray", reason="needs ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray



def test_ray_job_submit_serves_the_example_spec():
    if ray.is_initialized():
        ray.shutdown()         # the end below kills every Ray process of this user
    bin_dir = os.path.dirname(sys.executable)
    # Serve's proxies on Ray's own channel (the default spec asks for gRPC, which the rest of the
    # suite runs): this cluster's processes are started without it, and the launch says so.
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_SERVE_PROXY_USE_GRPC": "0"}
    ray_cli = os.path.join(bin_dir, "ray")
    gcs, dashboard, http = free_port(), free_port(), free_port()
    address = f"http://127.0.0.1:{dashboard}"
    token = subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                           text=True, timeout=60).stdout.strip()
    # Every port of this cluster's own: the job agent on the default port can collide with the
    # agent of a Ray that another test just shut down, and then no job is ever accepted.
    agent_ports = ["--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port",
                   str(free_port()), "--runtime-env-agent-port", str(free_port()),
                   "--metrics-export-port", str(free_port())]
    subprocess.run([ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
                    "--num-cpus", "8", "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                    "--dashboard-port", str(dashboard), "--disable-usage-stats", *agent_ports],
                   env=env, check=True, capture_output=True, timeout=180)
    try:
        deadline = time.monotonic() + 180
        while True:     # the job agent registers a little after `ray start` returns
            submitted = subprocess.run(
                [ray_cli, "job", "submit", "--address", address, "--no-wait", "--working-dir", REPO, "--",
                 "python", "-m", "cluster.launch", "--config", "deploy/examples/cpu-small.yaml", "--port",
                 str(http)], env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
            if submitted.returncode == 0 or "No available agent" not in submitted.stdout + submitted.stderr \
                    or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        job_id = re.search(r"raysubmit_\w+", submitted.stdout + submitted.stderr).group(0)
        # The job's status, logs and stop through the SDK's HTTP client, in this process: each CLI
        # call is a Python process of its own (1.5 s of CPU) that the server starting on this
        # machine's two cores would wait behind.
        from ray.job_submission import JobStatus, JobSubmissionClient

        jobs = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
        base = f"http://127.0.0.1:{http}"

        def job_alive() -> None:
            assert jobs.get_job_status(job_id) != JobStatus.FAILED, jobs.get_job_logs(job_id)[-3000:]
        wait_healthy(base, 300, job_alive, poll_s=1.0)

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                        temperature=0.0)
        assert out.choices[0].text and out.usage.completion_tokens == 8
        assert "Serve's proxies will use 'ray'" in jobs.get_job_logs(job_id)

        jobs.stop_job(job_id)
        deadline = time.monotonic() + 120
        while jobs.get_job_status(job_id) != JobStatus.STOPPED:
            assert time.monotonic() < deadline, "the job did not stop"
            time.sleep(0.5)
    finally:
        kill_ray_processes()        # `ray stop --force`, less its wait for init to reap what it killed


@pytest.mark.parametrize("engine,named", [({"max_num_seq": 8}, "engine.max_num_seq"),
                                          ({"block_size": 7}, "block_size must be a power of two"),
                                          ({"max_model_len": 1_000_000}, "max_model_len must be in")])
def test_a_bad_engine_field_is_refused_before_ray_starts(tmp_path, engine, named):
    """`pdserve serve` refuses a spec whose engine section is wrong (unknown field, bad value, a value
    the model does not allow), naming the field, with exit code 2, without reaching for Ray."""
    import yaml

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"engine": engine}))
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}   # nothing listens: reaching Ray would fail otherwise
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pdserve"), "serve", "--config", str(spec),
                           "--port", str(free_port())], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr and "127.0.0.1:1" not in done.stdout + done.stderr



def test_chat_template_from_a_file_or_inline(tiny_llama, tmp_path):
    """vLLM's --chat-template: a file's template (read into the spec, so remote ingress replicas get
    its text) or an inline one replaces the tokenizer's in the frontend, tools and /tokenize alike;
    anything else is refused naming the field. LLM.chat takes one per call."""
    import argparse

    from cluster.config import ClusterConfig
    from cluster.serve_args import add_serve_args, config_from_args
    from engine import LLM, SamplingParams
    from router.ingress.preparer import RequestPreparer

    template = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    path = tmp_path / "plain.jinja"
    path.write_text(template)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = config_from_args(parser.parse_args(["--model", tiny_llama, "--chat-template", str(path)]))
    assert config.serving.chat_template == template
    assert ClusterConfig.model_validate(config.model_dump()).serving.chat_template == template
    preparer = RequestPreparer(config.ingress_spec())
    ids = preparer.tokenize({"messages": [{"role": "user", "content": "Hi"}]})["tokens"]
    assert preparer.tokenizer.decode(ids) == "<<user>> Hi\n<<assistant>>"
    with pytest.raises(ValueError, match="chat_template must be a Jinja template or the path of a file"):
        ClusterConfig(model=tiny_llama, serving={"chat_template": str(tmp_path / "missing.jinja")})
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256)
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template=template)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "<<user>> Hi\n<<assistant>>"


def test_several_served_model_names_answer_as_one_model(tiny_llama, tmp_path):
    """`--served-model-name a b` (vLLM's): requests may name any, responses and the adapters' parent
    name the first, /v1/models has a card for each; an adapter may not take one of them, and a
    name given twice, blank or an empty list is refused naming the field."""
    import argparse

    from cluster.config import ClusterConfig
    from cluster.serve_args import add_serve_args, config_from_args
    from records.errors import NotFoundError
    from router.ingress.preparer import RequestPreparer

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = config_from_args(parser.parse_args(["--model", tiny_llama, "--served-model-name", "tiny", "tiny-chat"]))
    assert config.serving.served_model_name == ["tiny", "tiny-chat"]
    one = config_from_args(parser.parse_args(["--model", tiny_llama, "--served-model-name", "tiny"]))
    assert one.serving.served_model_name == "tiny"
    preparer = RequestPreparer(config.ingress_spec())
    assert preparer.model_name == "tiny" and preparer.check_model("tiny-chat") is None
    assert [card["id"] for card in preparer.models()["data"]] == ["tiny", "tiny-chat"]
    assert preparer.model("tiny-chat")["root"] == preparer.model("tiny")["root"]
    with pytest.raises(NotFoundError, match=r"'tiny-2' does not exist; this server serves \['tiny', 'tiny-chat'\]"):
        preparer.check_model("tiny-2")
    with pytest.raises(ValueError, match=r"lora.modules \['tiny-chat'\]: the base model is served under that name"):
        adapter = make_adapter(tiny_llama, str(tmp_path / "a"), 8, ["q_proj"], seed=1)
        ClusterConfig(model=tiny_llama, serving={"served_model_name": ["tiny", "tiny-chat"]},
                      lora={"modules": {"tiny-chat": adapter}})
    for bad, says in ((["a", "a"], "names a model twice"), ([], "at least one model"), (["a", " b"], "surrounding")):
        with pytest.raises(ValueError, match=f"served_model_name.*{says}"):
            ClusterConfig(model=tiny_llama, serving={"served_model_name": bad})


def test_vllm_named_flags_set_the_spec():
    """`pdserve serve`'s vLLM-named flags land in the spec's engine, serving and pool sections (on
    top of a spec file or the default), and a malformed one is refused naming the flag."""
    import argparse

    from cluster.config import ClusterConfig
    from cluster.serve_args import add_serve_args, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = config_from_args(parser.parse_args([
        "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "8", "--kv-cache-dtype", "fp8",
        "--no-enable-prefix-caching", "--enforce-eager", "--seed", "3", "-tp", "2", "--cpus-per-rank", "2",
        "--enable-expert-parallel", "--moe-dispatch", "all2all", "--served-model-name", "smol",
        "--api-key", "k", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--tenants-file", "/etc/pdserve/tenants.json", "--ingress-replicas", "2"]))
    engine = config.engine
    assert (engine.dtype, engine.max_model_len, engine.max_num_seqs, engine.kv_cache_dtype, engine.seed) == (
        "bfloat16", 1024, 8, "fp8", 3)
    assert engine.enable_prefix_caching is False and engine.enforce_eager is True
    assert engine.enable_chunked_prefill is True                  # untouched: the default
    assert {name: (spec.tensor_parallel_size, spec.num_cpus, spec.enable_expert_parallel, spec.moe_dispatch)
            for name, spec in config.pools.items()} == {"prefill": (2, 2.0, True, "all2all"),
                                                         "decode": (2, 2.0, True, "all2all")}
    assert config.engine_args("decode").enable_expert_parallel is True
    assert config.pools["decode"].speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert (config.serving.served_model_name, config.serving.api_key) == ("smol", "k")
    assert (config.serving.tenants_file, config.serving.ingress_replicas) == ("/etc/pdserve/tenants.json", 2)
    assert config_from_args(parser.parse_args([])).engine.max_num_seqs == 64    # no flags: the spec's
    # vLLM's tool-calling command line: --enable-auto-tool-choice is accepted (always on here)
    tools = config_from_args(parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                                "--trust-remote-code"]))
    assert tools.serving.tool_call_parser == "hermes"
    assert config_from_args(parser.parse_args(["/models/x", "--port", "9000"])).model == "/models/x"  # vllm serve M
    with pytest.raises(ValueError, match="the model is given twice"):
        config_from_args(parser.parse_args(["/models/x", "--model", "/models/y"]))
    # The cache's kv_* fields are the engine's (fp8 above); the connector's belong to disaggregation.
    with pytest.raises(ValueError, match="the disaggregation section configures"):
        ClusterConfig.model_validate({"engine": {"kv_connector": "nixl"}})
    with pytest.raises(ValueError, match="--speculative-config takes a JSON object"):
        config_from_args(parser.parse_args(["--speculative-config", "ngram"]))
    # CORS as vLLM's command lines give it (JSON lists), or comma-separated
    cors = config_from_args(parser.parse_args(["--allowed-origins", '["https://a.example"]', "--allow-credentials",
                                               "--allowed-headers", "authorization,content-type"])).serving
    assert (cors.allowed_origins, cors.allow_credentials, cors.allowed_methods, cors.allowed_headers) == (
        ["https://a.example"], True, ["*"], ["authorization", "content-type"])
    with pytest.raises(ValueError, match="--allowed-methods takes a JSON list of strings"):
        config_from_args(parser.parse_args(["--allowed-methods", '["GET", 1]']))
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pdserve"), "serve", "--block-size", "7"],
                          env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "block_size must be a power of two" in done.stderr, done.stderr
