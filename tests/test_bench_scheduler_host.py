"""bench/scheduler_host.py: the Engine's host time per step without a model, on the GPU workload's shapes."""

from bench.scheduler_host import main, measure, runner_step


def test_every_step_is_timed_once_as_decode_only_or_with_prefill():
    result = measure(num_requests=8, prompt_lens=(24, 48), output_lens=(4, 12), kv_memory="4MiB")
    steps = result["steps"]
    assert len(steps["with prefill"]) + len(steps["decode only"]) == result["num_steps"]
    assert steps["with prefill"] and steps["decode only"]  # prompts first, then decode-only steps to the end
    assert all(seconds > 0 for times in steps.values() for seconds in times)
    # The pool holds a few requests at a time: later ones are admitted as earlier ones finish.
    assert result["num_blocks"] == 8 and max(result["rows"]["decode only"]) < 8
    assert 0 < result["admission_s"] < sum(sum(times) for times in steps.values())
    assert result["num_preemptions"] == 0
    # Decode-only steps went through the decode runner, as on a GPU; the same steps and rows packed.
    assert result["runner_steps"] == len(steps["decode only"])
    packed = measure(num_requests=8, prompt_lens=(24, 48), output_lens=(4, 12), kv_memory="4MiB", decode_runner=False)
    assert packed["runner_steps"] == 0 and packed["rows"] == result["rows"]


def test_waiting_steps_start_waiting_requests_together_in_fewer_steps_that_prefill():
    """The burst through a pool that holds a few requests at a time: with `max_waiting_steps`, requests freed room
    for wait and start together, so fewer steps prefill, every token is still served and none is preempted."""
    runs = {
        k: measure(num_requests=24, prompt_lens=(24, 48), output_lens=(8, 24), kv_memory="8MiB", max_waiting_steps=k)
        for k in (0, 8)
    }
    assert all(run["num_preemptions"] == 0 for run in runs.values())
    assert runs[8]["output_tokens"] == runs[0]["output_tokens"]
    assert len(runs[8]["steps"]["with prefill"]) < len(runs[0]["steps"]["with prefill"])


def test_main_prints_the_table_and_the_host_bound(capsys):
    args = ["--num-requests", "4", "--prompt-lens", "16", "32", "--output-lens", "4", "8", "--kv-memory", "8MiB"]
    assert main([*args, "--repeats", "1", "--runner-rows", "2", "--max-waiting-steps", "0", "4"]) == 0
    out = capsys.readouterr().out
    assert "max_waiting_steps 0:" in out and "max_waiting_steps 4:" in out
    assert "| with prefill |" in out and "| decode only  |" in out
    assert "output tok/s" in out and "admission:" in out
    assert "decode runner" in out and "host us/row" in out


def test_a_runner_step_without_its_forward_takes_host_time_only():
    assert 0 < runner_step(2, steps=5) < 0.5  # a forward of the model takes milliseconds on its own
