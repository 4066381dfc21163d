"""The file ``spark-submit`` starts: ``hourglass spark ...`` with the CLI's error boundary.

    spark-submit --master spark://host:7077 --py-files hourglass.zip \\
        cluster/spark_submit.py audit /shared/nodes --out /shared/audit

(docs/spark.md, "Running on a Spark cluster"). The commands are ``cluster/cli/spark.py``.
"""

import sys

from cluster.cli import app

if __name__ == "__main__":
    app(["spark", *sys.argv[1:]], prog_name="hourglass")
