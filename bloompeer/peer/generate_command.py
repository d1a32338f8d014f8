def add_generate_parser(commands, add_network_flags):
    pass
