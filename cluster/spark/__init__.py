"""Hourglass on Spark: a data source over node log segments, an audit job and a bulk-schedule job.

Modules (one concept each):

* ``layout``  - which files: node folders, their role, one read task per segment file;
* ``scan``    - read-only frame scanner; torn and corrupt bytes become error frames, never exceptions;
* ``rows``    - Arrow record batches from frames: one row per message, built from whole
  ``cluster.codec`` batches with numpy;
* ``options`` - the data source's options: names, defaults, checks (also run by the CLI before Spark starts);
* ``source``  - the ``hourglass`` PySpark data source (schemas, partitions, filter pushdown);
* ``audit``   - scheduled vs cancelled vs dispatched vs received: lost, duplicated,
  delivered after cancel, lateness per subject and hour;
* ``report``  - the audit's summary, plots and HTML page;
* ``bulk``    - bulk-schedule: validate rows as one codec batch, send them with ``Producer.send_many``;
* ``outdir``  - a job's output folder: refused when it exists, written aside and renamed when done;
* ``session`` - SparkSession with ``local[*]`` by default and the data source registered;
* ``cli``     - ``hourglass spark audit|bulk-schedule``.

Only ``cli`` and ``session``-free pure modules import without pyspark; everything that
touches Spark imports it inside functions, so ``hourglass`` works without the extra.
See docs/spark.md.
"""
