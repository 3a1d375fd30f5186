"""Decisions shown before any GPU time: `produce --dry-run` prints the resolved layer ids and the export formats
they allow and rule out (with the --layers that would allow them); the pilot sizes its sample from the host's
batch and warns below it; a worker started with --run consumes the run's queues."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from app.base.errors import RegenError
from app.base.layers import parse_layers
from app.cli import main
from app.data import export_formats
from app.data.export_states import choose_layers
from app.data.format_fit import fits, layer_lines
from app.pilot.host import sample_size_for
from tests.support.redis_db import PRODUCER_REDIS
from tests.support.runs import produce, prompts_file
from workers.process.plan import run_queues

STATE_FORMATS = export_formats.names(export_formats.STATES)


def _fit(spec: str, n: int = 64) -> dict:
    return {f.format: f for f in fits(list(parse_layers(spec, n).vllm), n)}


def test_dflash_rules_out_the_formats_that_need_the_final_layer_and_says_what_allows_them():
    got = _fit("dflash")
    assert got["specforge-dflash"].allowed and got["sharegpt"].allowed and got["specforge-online"].allowed
    for name in ("speculators", "specforge-eagle3"):
        assert not got[name].allowed and "--layers vllm:2,17,32,47,62,64" in got[name].note, got[name]
    # the --layers it names allows them: speculators outright, EAGLE-3 with export --layers picking three
    fixed = _fit("vllm:2,17,32,47,62,64")
    assert all(fixed[name].allowed for name in STATE_FORMATS)
    assert "regen export --layers" in fixed["specforge-eagle3"].note
    assert all(f.allowed for f in _fit("eagle3").values())


def test_capture_off_rules_out_every_state_format():
    got = {f.format: f for f in fits(None, 64)}
    assert {n for n, f in got.items() if not f.allowed} == set(STATE_FORMATS)
    assert "--capture inline or staged" in got["speculators"].note


def test_the_rules_are_the_exporters_own():
    """What format_fit allows is what the exporter's layer choice accepts (app.data.export_states.choose_layers)."""
    for spec in ("dflash", "dflash-2", "eagle3", "vllm:2,17,32,47,62,64", "vllm:64", "hf:10,20,30"):
        ids = list(parse_layers(spec, 64).vllm)
        for f in fits(ids, 64):
            fmt = export_formats.get(f.format)
            if fmt.kind != export_formats.STATES:
                continue
            try:
                choose_layers(fmt.name, "r", ids, 64, None, fmt.final_layer, fmt.aux_layers)
                exporter_ok = True
            except RegenError:
                exporter_ok = False
            picks = "regen export --layers" in f.note  # allowed with an export --layers choosing the aux layers
            assert f.allowed == (exporter_ok or picks), (spec, f)


def test_the_dry_run_prints_the_layer_ids_and_the_formats(tiny_qwen3, tmp_path):
    inputs = prompts_file(tmp_path, with_formats=False)
    result = CliRunner().invoke(main, ["produce", str(inputs), "--model", str(tiny_qwen3), "--dry-run",
                                       "--layers", "dflash"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert re.search(r"layers: --layers dflash on a 4-layer model: vLLM ids 2 \(DFlash ids 1;", out), out
    assert "export formats allowed: sharegpt, parquet, specforge-jsonl, specforge-dflash" in out
    assert "  speculators: needs the final layer (vLLM id 4): --layers vllm:2,4" in out
    assert layer_lines(None)[0].startswith("layers: none (--capture off)")


@pytest.mark.parametrize(("devices", "given", "size", "warned"), [
    ({"engines": 7}, None, 7 * 512 * 2, False),      # a 7x B200 host, one engine per GPU: twice its batch
    ({"engines": 7}, 300, 300, True),                # the old default: five shards, the engines never fill
    ({"engines": 7}, 3584, 3584, False),             # one full batch
    ({"engines": 2}, None, 2 * 512 * 2, False),      # tensor-parallel pairs: fewer engines, a smaller batch
])
def test_the_pilot_sizes_its_sample_from_the_host_and_warns_below_one_batch(devices, given, size, warned):
    got, warning = sample_size_for(devices, 512, given)
    assert got == size and bool(warning) == warned
    if warned:
        assert "3,584 sequences (7 engine(s) x max_num_seqs 512)" in warning and "--sample 7168" in warning


@pytest.mark.parametrize(("extra", "queue", "want"), [((), "regen", "regen"),
                                                      (("--capture", "staged"), "regen", "regen,regen.capture"),
                                                      (("--capture", "staged"), "team-b", "team-b,regen.capture")])
def test_a_worker_of_a_run_consumes_the_runs_queues(extra, queue, want, tiny_qwen3, tmp_path, producer_redis):
    storage = tmp_path / "storage"
    produce(storage, "q", [prompts_file(tmp_path, with_formats=False)], tiny_qwen3, *extra, queue=queue,
            broker=PRODUCER_REDIS)
    assert run_queues(str(storage), "q") == want
