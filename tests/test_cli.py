"""The `harmony` command: readable output, JSON, plan files, clear errors."""

import json

import pytest

from harmony.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_prints_a_ranked_table_and_saves_the_best_plan(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    code, out, _ = run(
        capsys,
        "search",
        "--model",
        "bert-large",
        "--hardware",
        "paper-4x1080ti",
        "--minibatch",
        "16",
        "--policies",
        "harmony-pp",
        "--gpus",
        "2",
        "--no-progress",
        "--workers",
        "1",
        "--save-plan",
        str(plan),
    )
    assert code == 0
    assert "plans simulated" in out and "harmony-pp" in out and "best per policy" in out
    assert json.loads(plan.read_text())["policy"] == "harmony-pp"

    code, out, _ = run(
        capsys,
        "simulate",
        "--model",
        "bert-large",
        "--plan",
        str(plan),
        "--chrome",
        str(tmp_path / "t.json"),
        "--csv",
        str(tmp_path / "t.csv"),
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert report["summary"]["fits"] is True
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (
        (tmp_path / "t.csv")
        .read_text()
        .startswith("device,lane,kind,model,pack,microbatch,start_s,end_s,bytes")
    )


def test_search_json_is_machine_readable(capsys):
    code, out, _ = run(
        capsys,
        "search",
        "--model",
        "gpt2-tiny",
        "--hardware",
        "h100-pcie5",
        "--minibatch",
        "8",
        "--json",
        "--workers",
        "1",
        "--top",
        "3",
    )
    assert code == 0
    data = json.loads(out)
    assert len(data["rows"]) == 3
    assert data["rows"][0]["iteration_s"] <= data["rows"][1]["iteration_s"]
    assert data["rows"][0]["plan"]["minibatch"] == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["search", "--model", "gpt9", "--minibatch", "8"], "unknown model 'gpt9'"),
        (
            ["search", "--model", "gpt2-xl", "--hardware", "dgx-9000", "--minibatch", "8"],
            "unknown hardware preset",
        ),
        (
            ["search", "--model", "gpt2-xl", "--minibatch", "8", "--policies", "magic"],
            "unknown policy 'magic'",
        ),
        (["search", "--model", "gpt2-xl", "--minibatch", "8", "--gpus", "16"], "outside 1..4"),
        (["simulate", "--model", "gpt2-xl", "--plan", "/nonexistent/plan.json"], "does not exist"),
        (["simulate", "--model", "gpt2-xl"], "give --plan"),
        (
            ["search", "--model", "gpt2-xl", "--minibatch", "8", "--host-memory", "lots"],
            "cannot read --host-memory 'lots'",
        ),
        (
            ["search", "--model", "gpt2-xl", "--minibatch", "8", "--host-memory", "0"],
            "host_memory must be a positive number",
        ),
        (
            ["simulate", "--model", "gpt2-xl", "--minibatch", "8", "--disk", "floppy"],
            "cannot read --disk 'floppy': give a disk by name (nvme)",
        ),
        (
            ["simulate", "--model", "gpt2-xl", "--minibatch", "8", "--disk", "3GB/s"],
            "read and write bandwidths, e.g. '3GB/s,2GB/s'",
        ),
        (
            ["simulate", "--model", "gpt2-xl", "--minibatch", "8", "--disk", "fast,2GB/s"],
            "cannot read --disk read bandwidth 'fast'",
        ),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_bad_numbers_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["search", "--model", "gpt2-xl", "--minibatch", "-3"])
    assert e.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_listings(capsys):
    for cmd, needle in (
        ("models", "gpt2-xl"),
        ("presets", "paper-4x1080ti"),
        ("policies", "harmony-no-grouping"),
    ):
        code, out, _ = run(capsys, cmd)
        assert code == 0 and needle in out


def test_simulate_with_a_host_budget_and_a_disk_tier(capsys, tmp_path):
    from harmony import Plan
    from harmony.costs.catalog import model_spec

    plan = tmp_path / "plan.json"
    Plan.uniform("harmony-pp", 4, 32, 2, len(model_spec("gpt2-xl")), 4).to_json(plan)
    argv = ["simulate", "--model", "gpt2-xl", "--plan", str(plan), "--host-memory", "8GiB"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and "give the server a disk tier (--disk nvme" in err
    code, out, _ = run(capsys, *argv[:-1], "16GiB", "--disk", "nvme")
    assert code == 0 and "disk tier: read" in out and "gradients held in 2 pack slots" in out
    assert "stashes and offloaded activations on disk" not in out
    # with all its state on disk, 6 GiB is too little for its 2.31 GB of stashes: they go too
    code, out, _ = run(capsys, *argv[:-1], "6GiB", "--disk", "nvme")
    assert (
        code == 0
        and (
            "stashes and offloaded activations on disk, 2.31 GB per iteration, 2 per GPU each way "
            "in host memory, 210 MB"
        )
        in out
    )
    # the whole model's gradients would not fit beside its state: in slots, it all does
    code, out, _ = run(capsys, *argv[:-1], "24GiB", "--disk", "nvme")
    assert code == 0 and "gradients held in 2 pack slots" in out and "disk tier" not in out
    code, out, _ = run(capsys, *argv[:-1], "16GiB", "--disk", "3GB/s,2GB/s", "--json")
    summary = json.loads(out)["summary"]
    assert summary["disk_read_bytes"] > 0 and summary["bytes_by_kind"]["DISK_OUT"] > 0


@pytest.mark.parametrize("policy", ["hydra", "karma"])
def test_simulate_a_system_by_policy(capsys, policy):
    assert (
        main(
            ["simulate", "--model", "bert-large", "--minibatch", "8", "--policy", policy, "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["policy"] == policy and out["summary"]["iteration_s"] > 0


def test_train_in_mixed_precision(capsys, tmp_path):
    weights = tmp_path / "w.pt"
    assert (
        main(
            [
                "train",
                "--model",
                "gpt2-tiny",
                "--steps",
                "2",
                "--minibatch",
                "8",
                "--memory",
                "8MB",
                "--precision",
                "bf16",
                "--nonfinite",
                "skip",
                "--save",
                str(weights),
            ]
        )
        == 0
    )
    assert "final loss" in capsys.readouterr().out
    import torch

    assert all(
        t.dtype in (torch.float32, torch.int64) for t in torch.load(weights).values()
    )  # fp32 masters
