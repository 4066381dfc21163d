"""The web console (``hourglass console``, docs/console.md): one process that serves
server-rendered pages answering an operator's questions (cluster, schedule, message trace),
talking to the cluster through the meta servers and the nodes' gRPC APIs with the viewer's
own token, as the SDK and the CLI do.

Modules: ``views`` (pure: status rows, lookups and counts in, page models out),
``backend`` (the gRPC calls, per viewer), ``sessions`` (login, the CSRF token, pure
bookkeeping with time as an argument), ``app`` (the Starlette shell: routes, templates,
headers). It sits on the top floor beside ``cluster.cli`` and imports nothing of ``node``
or ``metaserver``.
"""
