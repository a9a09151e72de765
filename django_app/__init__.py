"""Django integration for task-locks (AppConfig label ``task_locks``).

Add ``"django_app"`` to ``INSTALLED_APPS`` and a ``TASK_LOCKS`` dict to settings (read
only in :mod:`django_app.conf`). The app configures :mod:`task_locks` from settings at
start-up, provides :class:`~django_app.commands.LockedCommand`, ``manage.py locks``, the
``django://ALIAS`` database backend, the admin's **Lock holders** and **Lock events**
pages and the fence table behind ``django_app.fencing``.
"""

#: Tells task-locks' app from a project's own ``django_app`` package that would hide it
#: (:mod:`task_locks.app_identity`).
__task_locks_app__ = True
