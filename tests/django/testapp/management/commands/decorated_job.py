"""A plain BaseCommand whose handle is wrapped by ``locked_command``."""

from django.core.management.base import BaseCommand

from django_app.commands import locked_command


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("account")

    @locked_command("job:{account}", ttl=10)
    def handle(self, *args, **options):
        self.stdout.write(f"job for {options['account']} under fence {self.lease.fence}")
