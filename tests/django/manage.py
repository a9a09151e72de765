#!/usr/bin/env python
"""``manage.py`` for the test settings; subprocess tests run commands through it."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
