"""`vlm_grpo.cli.stop`: the one line a Ctrl-C ends with, wherever in the run it came (the console script's own run is
`test_cli_messages.py::test_ctrl_c_is_one_line_naming_the_step_and_what_is_left_and_a_rerun_never_overwrites_it`)."""

from vlm_grpo.cli.stop import Stopped, stopped_line


def test_the_stop_line_says_what_the_run_left_wherever_it_stopped(tmp_path):
    assert stopped_line(None) == "stopped before training began; nothing was trained."
    out = str(tmp_path)
    assert stopped_line(Stopped(7, 400, out)).startswith("stopped at step 7 of 400; checkpoints: none (")
    # After training: the model saved is named, and what was not written.
    assert stopped_line(Stopped(400, 400, out, trained=True)) == (
        f"stopped at step 400 of 400, after training: {out}/final was not written; the held-out accuracy after, "
        "eval.json and the plot were not."
    )
    (tmp_path / "final").mkdir()
    assert f"the trained model is in {out}/final;" in stopped_line(Stopped(400, 400, out, trained=True))
    assert isinstance(Stopped(1, 2, out), KeyboardInterrupt)  # uncaught, still a Ctrl-C
