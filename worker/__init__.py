"""The Celery service: a thin shell over `pipeline` (see worker/app.py).

    settings.py   ServiceSettings: the only place in the service that reads the environment
    app.py        the Celery application and its reliability settings
    tasks.py      Celery tasks, thin shells named after the library steps they call
    dispatch.py   the units a job runs as, and the message that runs each one
    jobs.py       job records, progress, heartbeats and output locks, kept in Redis
    units.py      UnitRun: a task's unit registered in its job while it runs, its heartbeat thread, cancels seen
    client.py     submitting and cancelling jobs (the CLI and scheduled runs)
    security.py   what a submitted job may touch, checked at submission and in the worker
    staging.py    this machine's copies of a job's work files on a remote OUT
    schedules.py  recurring jobs, stored in Redis with celery-redbeat
    watchdog.py   re-dispatch the work of dead workers
    cli.py        gpufeed worker|beat|flower|submit|status|jobs|cancel|schedule
"""
