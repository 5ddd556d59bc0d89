"""xla_utils.diagnostics.measure: the child of xla_utils.check (its whole runs are in
test_readiness.py, through check())."""


def test_where_names_user_code_and_stops_at_the_packages_own_step():
    """An op reached through xla_utils' own step (any of its packages) has no user place;
    one from user code names the file and line."""
    import xla_utils.train.loop as loop
    from xla_utils.diagnostics import measure

    ns = {"where": measure._where}
    exec(compile("def step():\n    return where()\n", loop.__file__, "exec"), ns)
    assert ns["step"]() == ""

    def user_forward():
        return measure._where()

    assert user_forward().startswith("test_measure.py:") and "in user_forward" in user_forward()
