"""The app's configuration: the label is ``task_locks`` whatever the package is called."""

from __future__ import annotations

from pathlib import Path

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class TaskLocksConfig(AppConfig):
    name = "django_app"
    label = "task_locks"
    verbose_name = _("Task locks")
    default_auto_field = "django.db.models.BigAutoField"
    # Said explicitly: an editable install made before this package existed can make
    # ``django_app`` look like a namespace package with several locations.
    path = str(Path(__file__).resolve().parent)

    def ready(self) -> None:
        # Importing registers the system checks and the setting_changed receivers.
        from . import audit, checks, conf  # noqa: F401

        conf.apply()
        # The audit writer (and, with METRICS, the Prometheus collectors) subscribe to
        # the lock event stream: in every process that loads the app, workers included.
        audit.install()
