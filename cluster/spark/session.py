"""One way to get a SparkSession for Hourglass jobs: ``local[*]`` unless told otherwise.

Under ``spark-submit`` the master comes from the submit command (``master=None`` keeps
it); from the CLI the default is ``local[*]``. Either way the ``hourglass`` data source
is registered and Python filter pushdown is switched on (the reader implements it; Spark
refuses a pushdown reader when the switch is off).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

LOCAL_MASTER = "local[*]"


class SessionSettings(BaseModel):
    master: str | None = LOCAL_MASTER          # None: whatever spark-submit configured
    app_name: str = "hourglass"
    shuffle_partitions: int = Field(default=0, ge=0)   # 0: 2 x cores in local mode, Spark's default otherwise
    driver_memory: str | None = None           # e.g. "2g"; only effective when this process starts the JVM
    conf: dict[str, str] = {}
    log_level: str = "WARN"                    # Spark's log4j level once started (the CLI: OFF)


def build_session(settings: SessionSettings | None = None):
    """Create (or reuse) the session and register the data source."""
    import os

    from pyspark.sql import SparkSession

    from .source import register

    s = settings or SessionSettings()
    b = SparkSession.builder.appName(s.app_name)
    if s.master:
        b = b.master(s.master)
    b = b.config("spark.sql.python.filterPushdown.enabled", "true")
    b = b.config("spark.ui.showConsoleProgress", "false")
    if s.master and s.master.startswith("local"):
        parts = s.shuffle_partitions or 2 * (os.cpu_count() or 2)
        b = b.config("spark.sql.shuffle.partitions", str(parts))
        b = b.config("spark.ui.enabled", "false")
    elif s.shuffle_partitions:
        b = b.config("spark.sql.shuffle.partitions", str(s.shuffle_partitions))
    if s.driver_memory:
        b = b.config("spark.driver.memory", s.driver_memory)
    for k, v in s.conf.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel(s.log_level)
    register(spark)
    return spark
