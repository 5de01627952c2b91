"""Import order and unpatch against live objects (issue 15, points 6-8): a trainer created before
``import unsloth_adaptive_kl`` trains as stock TRL or gets a clear error. The cases run in a fresh
process, since the import patches TRL process-wide: one process for both (tests/fresh_process_cases.py), whose two
trainers are both created before the import."""

import pytest

from fresh_process_cases import FAILED, run_cases

CASES = {
    "stock": """
        trainer = trainers["stock"]
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == 2 and all(math.isfinite(h["kl"]) for h in logs)  # TRL's own loss and kl
        assert not any(k.startswith("adaptive_kl/") for h in trainer.state.log_history for k in h)
        print("ok")
    """,
    "asks_for_adaptation": """
        trainer = trainers["asks_for_adaptation"]
        trainer.args.kl_adaptation_method = "clip"  # set by hand after the import: cannot reach this trainer's loss
        try:
            trainer.train()
        except unsloth_adaptive_kl.PatchError as error:
            print("refused:", error)
        else:
            raise SystemExit("trained without the adaptation")
    """,
}


@pytest.fixture(scope="module")
def before_the_import(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("lifecycle")
    preamble = f"""
        import math, sys
        from trl import GRPOConfig, GRPOTrainer
        import toy  # examples/toy.py (on PYTHONPATH: tests/conftest.py); it does not import the package
        assert "unsloth_adaptive_kl" not in sys.modules
        trainers = {{}}
        for name in {list(CASES)!r}:
            args = GRPOConfig(output_dir={str(out)!r} + "/" + name, use_cpu=True, bf16=False, report_to="none", beta=0.04,
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=2,
                              logging_steps=1, save_strategy="no", seed=0)
            trainers[name] = GRPOTrainer(model={tiny_checkpoint!r}, reward_funcs=[toy.format_reward], args=args,
                                         train_dataset=toy.prompt_dataset(16))
        import unsloth_adaptive_kl
    """
    return run_cases(preamble, CASES)


def test_a_trainer_created_before_the_import_trains_as_stock_trl(before_the_import):
    stdout, stderr = before_the_import
    out, err = stdout["stock"], stderr["stock"]
    assert FAILED not in out and out.strip().endswith("ok"), out[-2000:] + err[-3000:]
    assert "created before `import unsloth_adaptive_kl`" in err and "as stock TRL" in err


def test_a_trainer_created_before_the_import_that_asks_for_adaptation_gets_a_clear_error(before_the_import):
    stdout, stderr = before_the_import
    out = stdout["asks_for_adaptation"]
    assert FAILED not in out, out[-2000:] + stderr["asks_for_adaptation"][-3000:]
    assert "refused:" in out and "created before `import unsloth_adaptive_kl`" in out
    assert "kl_adaptation_method='clip'" in out and "after the import" in out
