// compose-loader loads compose files the way Docker Compose does, with the
// compose-spec reference loader (github.com/compose-spec/compose-go): the
// files are merged, interpolated, checked against the Compose
// Specification's JSON Schema, normalised and checked for consistency (every
// service, network, volume and depends_on a service names exists, no
// dependency cycle). It prints the resulting model as JSON, for
// scripts/compose-check to compare with scripts/stack.
//
//	compose-loader [-env KEY=VALUE]... FILE...
//
// Interpolation sees only the -env values, never the caller's environment,
// so the model checked is the one a user gets with nothing set; every
// profile is enabled, so no service escapes the check. Exit status 0 with
// the model on stdout, 1 with the loader's error on stderr, 2 on bad usage.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
)

type envList []string

func (e *envList) String() string { return strings.Join(*e, ",") }

func (e *envList) Set(v string) error {
	if !strings.Contains(v, "=") {
		return fmt.Errorf("%q is not KEY=VALUE", v)
	}
	*e = append(*e, v)
	return nil
}

func main() {
	var env envList
	flag.Var(&env, "env", "a KEY=VALUE for interpolation (repeatable)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: compose-loader [-env KEY=VALUE]... FILE...")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(flag.Args(), env); err != nil {
		fmt.Fprintf(os.Stderr, "compose-loader: %v\n", err)
		os.Exit(1)
	}
}

func run(files []string, env []string) error {
	dir, err := filepath.Abs(filepath.Dir(files[0]))
	if err != nil {
		return err
	}
	options, err := cli.NewProjectOptions(files,
		cli.WithWorkingDirectory(dir),
		cli.WithEnv(env),
		cli.WithProfiles([]string{"*"}),
		cli.WithInterpolation(true),
		cli.WithNormalization(true),
		cli.WithConsistency(true),
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		return err
	}
	project, err := options.LoadProject(context.Background())
	if err != nil {
		return err
	}
	model, err := project.MarshalJSON()
	if err != nil {
		return err
	}
	_, err = os.Stdout.Write(append(model, '\n'))
	return err
}
