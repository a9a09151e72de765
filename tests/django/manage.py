#!/usr/bin/env python
"""``manage.py`` for the test settings; subprocess tests run commands through it (with the
checkout on ``PYTHONPATH``, for ``tests.django.settings``: see django_helpers)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
