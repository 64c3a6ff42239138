"""stub"""


def add_routes(app) -> None:
    pass
