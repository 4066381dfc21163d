"""One way to get a SparkSession for Hourglass jobs: ``local[*]`` unless told otherwise.

Under ``spark-submit`` the master comes from the submit command (``master=None`` keeps
it); from the CLI the default is ``local[*]``. Either way the ``hourglass`` data source
is registered and Python filter pushdown is switched on (the reader implements it; Spark
refuses a pushdown reader when the switch is off).

A local master stays on the loopback interface: ``SPARK_LOCAL_IP`` defaults to ``127.0.0.1``
for the JVM this process starts, and ``spark.driver.host`` / ``spark.driver.bindAddress`` to
the same for a JVM that ``spark-submit --master local[*]`` started (Spark would otherwise bind
its driver, block manager and UI to the first non-loopback address). An explicit
``SPARK_LOCAL_IP`` or ``spark.driver.*`` setting wins; a cluster master is left alone (its
executors must reach the driver: docs/spark.md, "Running on a Spark cluster").

The JVM keeps its default (tiered) compilers: compiling with C1 only
(``-XX:TieredStopAtLevel=1``) saved 40% of the JVM's CPU of a 1M-record audit but cost 30%
more at 10M, where the optimised code pays for its compilation (docs/benchmarks.md).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

LOCAL_MASTER = "local[*]"
LOOPBACK = "127.0.0.1"


class SessionSettings(BaseModel):
    master: str | None = LOCAL_MASTER          # None: whatever spark-submit configured
    app_name: str = "hourglass"
    shuffle_partitions: int = Field(default=0, ge=0)   # 0: 2 x cores in local mode, Spark's default otherwise
    driver_memory: str | None = None           # e.g. "2g"; only effective when this process starts the JVM
    conf: dict[str, str] = {}
    log_level: str = "WARN"                    # Spark's log4j level once started (the CLI: OFF)


def is_local(master: str | None) -> bool:
    return bool(master) and (master == "local" or master.startswith(("local[", "local-cluster[")))


def _submitted_master() -> str | None:
    """The master of a JVM that ``spark-submit`` started (``PYSPARK_GATEWAY_PORT`` set), else None."""
    import os

    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return None
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM: SparkConf then reads its settings
    return SparkConf().get("spark.master", None)


def build_session(settings: SessionSettings | None = None):
    """Create (or reuse) the session and register the data source."""
    import os

    from pyspark.sql import SparkSession

    from .source import register

    s = settings or SessionSettings()
    master = s.master or _submitted_master()
    b = SparkSession.builder.appName(s.app_name)
    if s.master:
        b = b.master(s.master)
    b = b.config("spark.sql.python.filterPushdown.enabled", "true")
    b = b.config("spark.ui.showConsoleProgress", "false")
    if is_local(master):
        local_ip = os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)  # for a JVM this process starts
        for k in ("spark.driver.host", "spark.driver.bindAddress"):
            if k not in s.conf:
                b = b.config(k, local_ip)
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
