def main(argv=None):
    print("speccycle")
