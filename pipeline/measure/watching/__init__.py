"""`gpufeed watch`: an unchanged training command (or a block of code) run under watch, and its verdict.

    run.py       run_watched(command) / watch(): the command started with the recorder, sampled, judged
    report.py    WatchReport and its parts: each loop's, GPU's and interval's figures, the Verdict
    sampler.py   Sampler: the process tree, the recorder's files and the GPUs, every interval
    records.py   the recorder's files read as untrusted input: records checked, bad ones dropped and counted
    verdict.py   judge(report): data-bound or compute-bound, what limits the data, the next step
    hook/        the recorder watch puts in the watched processes (standard library only)

`pipeline.measure.watch()` is `run.watch`.
"""
