// Command edl-fake-cri is a container runtime for kubelet in tests: k8s.io/cri-client's fake
// runtime (no processes, no images, no network) served on a unix socket with what a real kubelet
// needs from it, a JSON-lines log of every CreateContainer request, and a control socket on which
// a test makes a running container exit with a chosen code. With --exec it runs each container's
// command as a host process (see exec.go).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

const usage = `usage: edl-fake-cri --socket PATH --control PATH --log PATH [--fs-mountpoint DIR]
       [--exec --pod-ip-range CIDR [--cdi-dir DIR]...]

A fake CRI (v1) runtime for kubelet in tests. It runs nothing: containers only change state when
kubelet starts or stops them, or when a test makes one exit through the control socket.
Point kubelet at it with --container-runtime-endpoint=unix://PATH.

With --exec, containers are processes: StartContainer runs the container's command and args (no
image is pulled: the command must exist here) with kubelet's environment plus the env edits of its
CDI devices (resolved from the --cdi-dir specs; an unknown one fails CreateContainer), in a new
session and a mount namespace of its own copied from the runtime's (run the runtime in the node's
mount namespace), stdout and stderr to kubelet's log path in the CRI log format. Its exit code is
the container's. StopContainer sends SIGTERM to every process of the container, SIGKILL after the
timeout; removing the container or its sandbox, or stopping the runtime, kills what is left. Each
sandbox gets the next address of --pod-ip-range as its IP (use a 127/8 range: all of it is lo).

Every CreateContainer request is appended to --log as one JSON line (in exec mode with
"cdi_edits": the env, device nodes and mounts of its CDI devices; nodes and mounts are not made).

Control API, HTTP over the --control unix socket:
  POST /exit {"namespace": NS, "pod": POD, "container": NAME, "code": N}
        the newest running container NAME of pod NS/POD exits with code N;
        200 {"id", "attempt"}, 404 {"error", "containers"} if none runs, 400 on a bad request
  GET  /containers   every container: id, namespace, pod, container, attempt, state, exit_code, sandbox_id
                     (exec mode: pid while its first process lives, log_path)
  GET  /healthz      "ok"

Flags:
`

func main() {
	flag.Usage = func() {
		fmt.Fprint(flag.CommandLine.Output(), usage)
		flag.PrintDefaults()
	}
	socket := flag.String("socket", "", "CRI endpoint (unix socket) to serve (required)")
	control := flag.String("control", "", "unix socket of the control API (required)")
	logPath := flag.String("log", "", "file to append one JSON line per CreateContainer request to (required)")
	mountpoint := flag.String("fs-mountpoint", "/", "real mountpoint reported as the image and container filesystem")
	execMode := flag.Bool("exec", false, "run containers as host processes")
	podIPs := flag.String("pod-ip-range", "", "exec mode: the range sandbox IPs are taken from, e.g. 127.64.0.0/16")
	var cdiDirs []string
	flag.Func("cdi-dir", "exec mode: a directory of CDI specs (repeatable; later ones take precedence)", func(dir string) error {
		cdiDirs = append(cdiDirs, dir)
		return nil
	})
	flag.Parse()
	if *socket == "" || *control == "" || *logPath == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "edl-fake-cri: --socket, --control and --log are required, and nothing else")
		flag.Usage()
		os.Exit(2)
	}
	var execConf *execConfig
	if *execMode {
		prefix, err := netip.ParsePrefix(*podIPs)
		if err != nil {
			fmt.Fprintf(os.Stderr, "edl-fake-cri: --exec needs --pod-ip-range CIDR: %v\n", err)
			os.Exit(2)
		}
		execConf = &execConfig{podIPs: prefix, cdiDirs: cdiDirs}
	} else if *podIPs != "" || len(cdiDirs) > 0 {
		fmt.Fprintln(os.Stderr, "edl-fake-cri: --pod-ip-range and --cdi-dir need --exec")
		os.Exit(2)
	}
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	log.SetPrefix("edl-fake-cri: ")

	srv, err := start(*socket, *control, *logPath, *mountpoint, execConf)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("serving CRI on %s, control API on %s, CreateContainer log %s, filesystem %s, exec mode %v",
		*socket, *control, *logPath, *mountpoint, *execMode)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	log.Printf("%s: stopping", <-signals)
	srv.stop()
}

type server struct {
	runtime *runtime
	grpc    *grpc.Server
	http    *http.Server
	sockets []string
	done    chan struct{}
}

// start serves the runtime on socket and the control API on control until stop.
// execMode nil: containers are records only.
func start(socket, control, logPath, mountpoint string, execMode *execConfig) (*server, error) {
	rt, err := newRuntime(logPath, mountpoint, execMode)
	if err != nil {
		return nil, err
	}
	criListener, err := listen(socket)
	if err != nil {
		rt.close()
		return nil, err
	}
	controlListener, err := listen(control)
	if err != nil {
		_ = criListener.Close()
		rt.close()
		return nil, err
	}
	s := &server{
		runtime: rt,
		grpc:    grpc.NewServer(),
		http:    &http.Server{Handler: rt.controlHandler(), ReadHeaderTimeout: 10 * time.Second},
		sockets: []string{socket, control},
		done:    make(chan struct{}),
	}
	runtimeapi.RegisterRuntimeServiceServer(s.grpc, rt)
	runtimeapi.RegisterImageServiceServer(s.grpc, rt)
	go func() {
		if err := s.grpc.Serve(criListener); err != nil {
			log.Fatalf("serving CRI: %v", err)
		}
	}()
	go func() {
		if err := s.http.Serve(controlListener); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Fatalf("serving the control API: %v", err)
		}
	}()
	go rt.trimCallRecords(s.done)
	if rt.exec != nil {
		go rt.reap(s.done)
	}
	return s, nil
}

func (s *server) stop() {
	s.runtime.killAll()
	close(s.done)
	s.grpc.Stop()
	_ = s.http.Close()
	for _, path := range s.sockets {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			log.Printf("removing %s: %v", path, err)
		}
	}
	s.runtime.close()
}

// listen replaces a socket file left behind by an earlier run.
func listen(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("removing the stale socket %s: %w", path, err)
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	return listener, nil
}
