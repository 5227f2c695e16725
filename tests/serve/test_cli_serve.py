"""`cfr-atlas serve`: argument handling and wiring, with uvicorn.run replaced by a recorder."""

from __future__ import annotations

import uvicorn

from cfr_atlas import cli


def test_serve_defaults_are_loopback_and_ollama_port():
    a = cli._parser().parse_args(["serve"])
    assert (a.host, a.port, a.model, a.kv_budget, a.prefix_cache) == (
        "127.0.0.1", 11434, None, None, None)


def test_serve_wires_config_into_uvicorn(monkeypatch, tiny_llama, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    code = cli.main(["serve", "--model", str(tiny_llama), "--port", "8123", "--name", "mini",
                     "--kv-budget", "1MiB", "--cache-dir", str(tmp_path), "--max-active", "2",
                     "--max-queue", "3", "--max-tokens", "64", "--prefix-cache",
                     str(tmp_path / "prefix")])
    assert code == 0
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8123)
    service = seen["app"].state.service
    cfg = service.config
    assert (cfg.kv_budget, cfg.max_active, cfg.max_queue, cfg.max_tokens) == (1 << 20, 2, 3, 64)
    assert service.card.name == "mini:latest"
    err = capsys.readouterr().err
    assert "serving mini:latest on http://127.0.0.1:8123" in err


def test_serve_bad_arguments_exit_2(capsys):
    assert cli.main(["serve", "--kv-budget", "lots"]) == 2
    assert cli.main(["serve", "--max-queue", "0"]) == 2
    assert "max_queue" in capsys.readouterr().err


def test_serve_passes_the_prefix_cache_options_to_load_model(monkeypatch, tmp_path):
    import cfr_atlas.serve as serve_pkg

    seen = {}
    monkeypatch.setattr(serve_pkg, "serve", lambda config, **kw: seen.update(kw))
    assert cli.main(["serve", "--prefix-cache", str(tmp_path), "--prefix-cache-bytes",
                     "2GiB"]) == 0
    assert seen == {"prefix_cache": str(tmp_path), "prefix_cache_bytes": "2GiB", "matmul": "float",
                    "prefix_store": None, "prefix_store_ttl": None, "expert_budget": None,
                    "expert_policy": "lru", "expert_reads": "auto"}


def test_serve_accepts_a_percentage_budget(monkeypatch, tiny_llama, tmp_path):
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    assert cli.main(["serve", "--model", str(tiny_llama), "--kv-budget", "10%",
                     "--cache-dir", str(tmp_path)]) == 0
    service = seen["app"].state.service
    c = service.model.config
    probe = service.model.session()
    itemsize = probe.atlas.config.dtype.itemsize
    probe.close()
    full = c.context_length * 2 * c.n_layers * c.n_kv_heads * c.head_dim * itemsize
    assert service.config.kv_budget == "10%" and service.ceiling == full // 10


def test_serve_refuses_a_bad_percentage(capsys):
    assert cli.main(["serve", "--kv-budget", "0%"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cfr-atlas: error: kv_budget: ") and "e.g. 10%" in err


def test_serve_passes_the_prefix_store_options_to_load_model(monkeypatch):
    import cfr_atlas.serve as serve_pkg

    seen = {}
    monkeypatch.setattr(serve_pkg, "serve", lambda config, **kw: seen.update(kw))
    assert cli.main(["serve", "--prefix-store", "redis://10.0.0.5:6379/2",
                     "--prefix-store-ttl", "3600"]) == 0
    assert (seen["prefix_store"], seen["prefix_store_ttl"]) == ("redis://10.0.0.5:6379/2", 3600)


def test_serve_refuses_a_bad_prefix_store(monkeypatch, tiny_llama, capsys):
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    assert cli.main(["serve", "--model", str(tiny_llama), "--prefix-store",
                     "http://localhost:6379"]) == 2
    assert "prefix_store: must be a redis://HOST:PORT/DB URL" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(tiny_llama), "--prefix-store",
                     "redis://127.0.0.1:1/0", "--prefix-store-ttl", "0"]) == 2
    assert "prefix_store_ttl" in capsys.readouterr().err


def test_serve_releases_the_main_threads_kernel_pool_before_serving(monkeypatch, tiny_llama):
    """The scheduler thread runs every kernel once serving starts: the pool the warm-up built
    on the main thread is freed first (kernel_threads.py: kept, it makes the scheduler's
    parallel kernels sleep at every barrier)."""
    import cfr_atlas.serve.app as app_mod

    order = []
    real_warm_up = app_mod.warm_up
    monkeypatch.setattr(app_mod, "warm_up", lambda m: order.append("warm") or real_warm_up(m))
    monkeypatch.setattr(app_mod, "release_pool", lambda: order.append("release") or True)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: order.append("run"))
    assert cli.main(["serve", "--model", str(tiny_llama)]) == 0
    assert order == ["warm", "release", "run"]


def test_the_warm_up_runs_a_batched_decode_step(monkeypatch, tiny_llama):
    """Before serving, a decode step of two sequences at once builds the batched walks
    (their typed lists cost a process ~1 s of compiling, paid here, not by a client)."""
    import cfr_atlas.serve.app as app_mod
    from cfr_atlas.atlas import batch_walk, decode_walk
    from cfr_atlas.engine import load_model

    made, drivers = [], []
    real_run = batch_walk.HotWalks.run
    monkeypatch.setattr(batch_walk.HotWalks, "run",
                        lambda self, *a, **k: made.append(real_run(self, *a, **k)) or made[-1])
    for name in ("hot_walks", "hot_walks_parallel"):
        real_kernel = getattr(decode_walk, name)
        monkeypatch.setattr(decode_walk, name, lambda *a, _k=real_kernel, _n=name:
                            drivers.append(_n) or _k(*a))
    real_one = decode_walk.hot_walk_one
    monkeypatch.setattr(decode_walk, "hot_walk_one",
                        lambda *a: drivers.append("hot_walk_one") or real_one(*a))
    model = load_model(tiny_llama)
    app_mod.warm_up(model)
    n = model.config.n_layers
    pairs = [ok for ok in made if len(ok) == 2]  # the steps of two sequences
    assert len(pairs) == 3 * n and all(ok.all() for ok in pairs[n:])  # steps 2 and 3 batched
    # both drivers compiled, and the single-member call (the stream's own decode)
    assert set(drivers) == {"hot_walks", "hot_walks_parallel", "hot_walk_one"}
