from kvray.cli import main

main()
