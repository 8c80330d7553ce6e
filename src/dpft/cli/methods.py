"""The method commands of ``dpft``: ``ldp-server`` and ``ldp-client`` (DP-Forward's split
deployment) and ``selft`` (DP-SelFT's layer selection); registered on the app by cli.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from dpft.cli.common import fail as _fail, name_run as _name_run, overrides as _overrides
from dpft.outputs.lock import RunLock
from dpft.config.recipe import load_recipe
from dpft.outputs.report import epsilon_line
from dpft.synth.generators import GeneratorError, HFCausalLMBackend, OpenAIChatBackend, build_candidate_pool

__all__ = ["ldp_server", "ldp_client", "selft"]


def ldp_server(
    recipe: Path = typer.Argument(..., help="Recipe with an ldp: section (e.g. recipes/sst2-minilm-ewft.yaml)."),
    port: int = typer.Option(8765, "--port", help="Port (0 = any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; non-loopback needs TLS."),
    output_dir: Path = typer.Option(Path("runs/ldp-server"), "--output-dir", "-o", help="Where post(·) and wire.jsonl go."),
    set: Optional[List[str]] = typer.Option(None, "--set", help="Any recipe key: --set ldp.position=output"),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="Bearer token file: read if it exists, else a new token is written there (0600). "
                                   "Default: a new token in OUTPUT_DIR/ldp_token."),
    ssl_certfile: Optional[Path] = typer.Option(None, "--ssl-certfile", help="PEM certificate: serve HTTPS."),
    ssl_keyfile: Optional[Path] = typer.Option(None, "--ssl-keyfile", help="PEM private key of --ssl-certfile."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="Largest batch (rows) accepted; "
                                            "default max(eval batch, B + 10√B + 16)."),
    max_body_bytes: Optional[int] = typer.Option(None, "--max-body-bytes", help="Largest tensor body; default "
                                                 "max_batch × T × k × 4 + max_batch × 8 + 64 KiB."),
):
    """Service provider of split forward-LDP training: trains post(·) on noisy codes only."""
    from dpft.methods.ewft.split import load_or_create_token, make_server

    try:
        rec = load_recipe(recipe, *_overrides(set=set))
        tfile = token_file if token_file is not None else output_dir / "ldp_token"
        token = load_or_create_token(tfile, overwrite=token_file is None)
        srv = make_server(rec, output_dir, port=port, host=host, token=token,
                          ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
                          ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
                          max_batch=max_batch, max_body_bytes=max_body_bytes)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"token file: {tfile}")
    typer.echo(f"listening on {srv.url}")
    sys.stdout.flush()
    srv.serve_forever()
    typer.echo(f"finished; post(·) in {output_dir}/model, wire log {output_dir}/wire.jsonl")


def ldp_client(
    recipe: Path = typer.Argument(..., help="The same recipe as the server's."),
    server: str = typer.Option("http://127.0.0.1:8765", "--server", help="ldp-server URL (http:// on loopback only)."),
    output_dir: Path = typer.Option(Path("runs/ldp-client"), "--output-dir", "-o", help="Client ledger and report."),
    set: Optional[List[str]] = typer.Option(None, "--set", help="Any recipe key."),
    token_file: Optional[Path] = typer.Option(None, "--token-file", help="The server's bearer token file "
                                              "(default: $DPFT_LDP_TOKEN)."),
    ca_file: Optional[Path] = typer.Option(None, "--ca-file", help="PEM CA bundle to verify an https:// server."),
    encoder_sha256: Optional[str] = typer.Option(None, "--encoder-sha256", help="Refuse an encoder whose sha256 pin "
                                                 "differs (the pin is in client_report.json of an earlier run)."),
):
    """Data holder of split forward-LDP training: pre(·) + encoder + clip + noise, sends noisy codes."""
    import os

    from dpft.methods.ewft.split import LDPClient, read_token

    try:
        if token_file is not None:
            token = read_token(token_file)
        elif os.environ.get("DPFT_LDP_TOKEN"):
            token = os.environ["DPFT_LDP_TOKEN"].strip()
        else:
            _fail("ldp-client needs the server's token: --token-file PATH (the server prints where it wrote it) "
                  "or DPFT_LDP_TOKEN")
        rep = LDPClient(load_recipe(recipe, *_overrides(set=set)), server, output_dir, token=token,
                        ca_file=str(ca_file) if ca_file else None, encoder_sha256=encoder_sha256).run()
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"dev accuracy: {rep['dev_accuracy']:.4f}")
    typer.echo(f"encoder sha256 (pin with --encoder-sha256): {rep['encoder_sha256']}")
    typer.echo(f"ε (stream, PLD) = {rep['epsilon_stream']:.4g} at δ = {rep['delta']:g}; local ε per release by "
               f"epoch = {[round(x, 3) for x in rep['epsilon_local_per_release']]}")
    typer.echo(f"example-level ε of this split deployment (server links rows to users, no amplification) = "
               f"{rep['epsilon_example_split_deployment']:.4g} at δ = {rep['delta']:g}; the stream ε above "
               f"assumes amplification; labels: {rep['privacy']['label']['privacy']} (see client_report.json)")
    dev = rep["privacy"]["dev_releases"]
    typer.echo(f"dev examples: one noisy code each at σ = {dev['sigma']:.4g}, ε = {dev['epsilon_code']:.4g} per "
               f"dev example; labels {dev['labels']}")
    if rep["privacy"]["randomness"]["mode"] != "secure":
        typer.echo(rep["privacy"]["randomness"]["statement"])


def selft(
    recipe: Optional[Path] = typer.Argument(None, help="YAML recipe (task, model, ε total, steps…)."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="Run directory."),
    candidates: Optional[Path] = typer.Option(None, help="File of public candidates (txt/csv/tsv/jsonl/parquet)."),
    candidates_column: str = typer.Option("text", help="Column of the candidate file."),
    generate: Optional[str] = typer.Option(None, help="Build the pool instead: hf:<causal LM folder> or "
                                           "openai:<model> (DPFT_LLM_BASE_URL / DPFT_LLM_API_KEY)."),
    gen_task: str = typer.Option("sst2", help="Appendix C template for --generate (sst2, sst5, mnli, qqp)."),
    n_seeds: int = typer.Option(600, help="Seeds for --generate (μ paraphrases each)."),
    mu: int = typer.Option(3, help="Paraphrases per seed for --generate."),
    epsilon_syn: float = typer.Option(0.3, help="ε of DP select-and-label (part of the total ε)."),
    top_k: int = typer.Option(3, help="Units kept."),
    selector: str = typer.Option("selft", help="selft, random_noise, no_noise, loss, gradient, attention."),
    granularity: str = typer.Option("block", help="Units: block (blocks+embeddings+head) or linear."),
    n_select: Optional[int] = typer.Option(None, help="Candidates kept by noisy votes (default min(pool, N))."),
    score_steps: int = typer.Option(30, help="Temporary-training steps per unit."),
    lora: bool = typer.Option(False, "--lora", help="DP-SelFT+LoRA: LoRA on the selected units only."),
    cache_dir: Optional[Path] = typer.Option(None, help="Cache of per-unit scores."),
    set: Optional[List[str]] = typer.Option(None, "--set", help="Any recipe key: --set optimizer.lr=1e-3"),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
):
    """DP-SelFT: DP synthetic data → perturbation-aware unit selection → DP fine-tuning of the
    selected units; one ledger for both phases."""
    from dpft.methods.selft import SelFTCfg, run_selft
    from dpft.run.loop import TrainingError, train_phase

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # DDP: selection draws its own key on each rank
        from dpft.methods.selft import DDP_REFUSAL

        _fail(DDP_REFUSAL)
    try:
        ov, origins = _overrides((("--output-dir", "output_dir", str(output_dir) if output_dir else None),), set)
        rec = load_recipe(recipe, ov, origins)
        _name_run(rec, ov)
        if rec.task.test_file and not Path(rec.task.test_file).is_file():  # before any loading
            _fail(f"test file not found: {rec.task.test_file}")
        pool = None
        if generate:
            kind, _, arg = generate.partition(":")
            if kind == "hf":
                be = HFCausalLMBackend(arg, seed=rec.seed)
            elif kind == "openai":
                be = OpenAIChatBackend(model=arg or "gpt-4o-mini")
            else:
                _fail("--generate must be hf:<folder> or openai:<model>")
            pool = build_candidate_pool(be, gen_task, n_seeds, mu).texts
        elif candidates is None:
            _fail("give --candidates FILE or --generate hf:<folder>|openai:<model>")
        cfg = SelFTCfg(epsilon_syn=epsilon_syn, candidates_file=str(candidates) if candidates else None,
                       candidates_column=candidates_column, top_k=top_k, selector=selector,
                       granularity=granularity, n_select=n_select, score_steps=score_steps, lora=lora,
                       cache_dir=str(cache_dir) if cache_dir else None)
        run_dir = Path(rec.output_dir or f"runs/{rec.name}-selft")
        with RunLock.for_dir(run_dir):  # one process writes a run folder (outputs/lock.py)
            rep = run_selft(rec, cfg, run_dir, candidates=pool, progress=not quiet,
                            log=lambda m: typer.echo(m, err=True), train_phase=train_phase)  # the driver runs phase 2
    except (ValueError, TrainingError, FileNotFoundError, GeneratorError) as exc:
        _fail(str(exc))
    typer.echo(f"run directory: {run_dir}")
    typer.echo(f"selected units: {rep['selft']['selected_units']}")
    typer.echo(f"dev accuracy: {rep['metrics']['dev_accuracy']:.4f}")
    typer.echo(epsilon_line(rep))
