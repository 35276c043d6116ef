"""Statistics across seeds as rliable (Agarwal et al. 2021) computes them: the IQM and its stratified bootstrap CI."""

import numpy as np


def iqm(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """The mean of the middle half, floor(n/4) scores dropped from each end (scipy.stats.trim_mean(scores, 0.25))."""
    n = scores.shape[axis]
    return np.sort(scores, axis=axis).take(range(n // 4, n - n // 4), axis=axis).mean(axis=axis)


def stratified_bootstrap_ci(scores: dict[str, np.ndarray], reps: int = 10_000, seed: int = 0, level: float = 0.95):
    """The percentile interval of the IQM over `reps` resamples, each drawing every stratum's (env's) runs with
    replacement from that stratum alone and pooling them (rliable's stratified bootstrap)."""
    rng = np.random.default_rng(seed)
    pooled = [runs[rng.integers(0, len(runs), size=(reps, len(runs)))] for runs in scores.values()]
    samples = iqm(np.concatenate(pooled, axis=1), axis=1)
    return tuple(np.percentile(samples, [100 * (1 - level) / 2, 100 * (1 + level) / 2]))


def aggregate(summaries: list[dict], reps: int = 10_000, seed: int = 0) -> dict:
    """Runs' summary.json files in one: how many reached the target, how many the env's solved level (None: it has
    none) and the median and IQR of their steps to it, the final evaluations' IQM with a 95% bootstrap CI (or None)."""
    steps = np.array([s["solved_at_step"] for s in summaries if s["solved_at_step"] is not None], dtype=float)
    evals: dict[str, list[float]] = {}
    for s in summaries:
        if s["eval_mean_return"] is not None:
            evals.setdefault(s["env_id"], []).append(s["eval_mean_return"])
    solved = None if summaries[0].get("solved_threshold", 0) is None else len(steps)  # Atari's, Brax's: no level
    agg = dict(runs=len(summaries), seeds=sorted(s["seed"] for s in summaries), solved=solved)
    agg |= {"target_return": summaries[0]["args"]["target_return"]} if "args" in summaries[0] else {}  # the flag's
    agg |= dict(target_reached=sum(s["status"] == "target return reached" for s in summaries))
    agg |= dict(solved_at_step_median=None, solved_at_step_iqr=None, evaluated=sum(map(len, evals.values())))
    agg |= dict(eval_iqm=None, eval_iqm_ci95=None)
    if len(steps):
        q1, median, q3 = np.percentile(steps, [25, 50, 75]).tolist()
        agg.update(solved_at_step_median=median, solved_at_step_iqr=[q1, q3])
    if evals:
        ci = stratified_bootstrap_ci({env: np.array(v) for env, v in evals.items()}, reps, seed)
        agg.update(eval_iqm=float(iqm(np.concatenate(list(evals.values())))), eval_iqm_ci95=[float(x) for x in ci])
    return agg


def line(agg: dict) -> str:
    evals = "no evaluation"
    if agg["eval_iqm"] is not None:
        low, high = agg["eval_iqm_ci95"]
        evals = f"eval IQM {agg['eval_iqm']:.1f} (95% CI {low:.1f}–{high:.1f}, {agg['evaluated']} runs)"
    if "solved" not in agg:  # --eval-only's aggregate: nothing trained, so nothing reached or solved
        return evals
    steps = "none solved" if agg["solved"] == 0 else "no solved level"
    if agg["solved"]:
        (q1, q3), median = agg["solved_at_step_iqr"], agg["solved_at_step_median"]
        steps = f"solved at step median {median:,.0f} (IQR {q1:,.0f}–{q3:,.0f}) of {agg['solved']}"
    reached = f"{agg['target_reached']}/{agg['runs']} reached the target"
    reached = "no target" if "target_return" in agg and agg["target_return"] is None else reached
    return f"{reached}; {steps}; {evals}"
