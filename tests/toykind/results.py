"""The toy kind's job result (pure) and its ``ctl status --json`` field."""


def total(results: dict) -> dict:
    sums = {r["sum"] for r in results.values()}
    resumed = {str(rank): r.get("resumed_from") for rank, r in results.items()}
    return {"sum": sums.pop() if len(sums) == 1 else None, "ranks": len(results), "resumed_from": resumed}


def summary(result) -> dict:
    return {"toy_sum": (result or {}).get("sum")}
