"""Import order and unpatch against live objects (issue 15, points 6-8): a trainer created before
``import unsloth_adaptive_kl`` trains as stock TRL or gets a clear error. Each case runs in a fresh
process, since the import patches TRL process-wide."""

import subprocess
import sys
import textwrap


def run(script: str):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)


def script(checkpoint, out, after_import: str) -> str:
    return f"""
        import importlib.util, math, sys
        from trl import GRPOConfig, GRPOTrainer
        import toy  # examples/toy.py (on PYTHONPATH: tests/conftest.py); it does not import the package
        assert "unsloth_adaptive_kl" not in sys.modules
        args = GRPOConfig(output_dir={str(out)!r}, use_cpu=True, bf16=False, report_to="none", beta=0.04, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=4, max_steps=2, logging_steps=1, save_strategy="no", seed=0)
        trainer = GRPOTrainer(model={checkpoint!r}, reward_funcs=[toy.format_reward], args=args, train_dataset=toy.prompt_dataset(16))
        import unsloth_adaptive_kl
        {after_import}
        """


def test_a_trainer_created_before_the_import_trains_as_stock_trl(tiny_checkpoint, tmp_path):
    proc = run(script(tiny_checkpoint, tmp_path, """
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == 2 and all(math.isfinite(h["kl"]) for h in logs)  # TRL's own loss and kl
        assert not any(k.startswith("adaptive_kl/") for h in trainer.state.log_history for k in h)
        print("ok")
    """))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
    assert "created before `import unsloth_adaptive_kl`" in proc.stderr and "as stock TRL" in proc.stderr


def test_a_trainer_created_before_the_import_that_asks_for_adaptation_gets_a_clear_error(tiny_checkpoint, tmp_path):
    proc = run(script(tiny_checkpoint, tmp_path, """
        trainer.args.kl_adaptation_method = "clip"  # set by hand after the import: cannot reach this trainer's loss
        try:
            trainer.train()
        except unsloth_adaptive_kl.PatchError as error:
            print("refused:", error)
        else:
            raise SystemExit("trained without the adaptation")
    """))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "refused:" in proc.stdout and "created before `import unsloth_adaptive_kl`" in proc.stdout
    assert "kl_adaptation_method='clip'" in proc.stdout and "after the import" in proc.stdout
