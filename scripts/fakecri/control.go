package main

import (
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"sort"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	apitest "k8s.io/cri-api/pkg/apis/testing"
)

// Labels kubelet puts on every container it creates.
const (
	podNamespaceLabel  = "io.kubernetes.pod.namespace"
	podNameLabel       = "io.kubernetes.pod.name"
	containerNameLabel = "io.kubernetes.container.name"
)

type exitRequest struct {
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	Container string `json:"container"`
	Code      *int32 `json:"code"`
}

type containerView struct {
	ID        string `json:"id"`
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	Container string `json:"container"`
	Attempt   uint32 `json:"attempt"`
	State     string `json:"state"`
	ExitCode  int32  `json:"exit_code"`
	SandboxID string `json:"sandbox_id"`
	Pid       int    `json:"pid,omitempty"`      // exec mode: the first process, until it is reaped
	LogPath   string `json:"log_path,omitempty"` // exec mode: as kubelet's mount namespace sees it
}

func (r *runtime) view(c *apitest.FakeContainer) containerView {
	v := containerView{
		ID:        c.Id,
		Namespace: c.Labels[podNamespaceLabel],
		Pod:       c.Labels[podNameLabel],
		Container: c.Labels[containerNameLabel],
		Attempt:   c.GetMetadata().GetAttempt(),
		State:     c.State.String(),
		ExitCode:  c.ExitCode,
		SandboxID: c.SandboxID,
	}
	if r.exec != nil {
		if p := r.exec.procs[c.Id]; p != nil {
			v.Pid, v.LogPath = p.pid, c.LogPath
		}
	}
	return v
}

func (r *runtime) controlHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok"))
	})
	mux.HandleFunc("GET /containers", func(w http.ResponseWriter, _ *http.Request) {
		r.RuntimeService.Lock()
		views := r.viewsLocked(func(*apitest.FakeContainer) bool { return true })
		r.RuntimeService.Unlock()
		reply(w, http.StatusOK, views)
	})
	mux.HandleFunc("POST /exit", r.exit)
	return mux
}

// viewsLocked lists the containers that keep accepts, sorted by id; the caller holds the lock.
func (r *runtime) viewsLocked(keep func(*apitest.FakeContainer) bool) []containerView {
	views := []containerView{}
	for _, c := range r.RuntimeService.Containers {
		if keep(c) {
			views = append(views, r.view(c))
		}
	}
	sort.Slice(views, func(i, j int) bool { return views[i].ID < views[j].ID })
	return views
}

// exit ends the newest running instance of a pod's container with the requested code, as if its
// process had exited; kubelet sees that on its next relist and applies the pod's restartPolicy.
func (r *runtime) exit(w http.ResponseWriter, req *http.Request) {
	var body exitRequest
	if err := json.NewDecoder(req.Body).Decode(&body); err != nil {
		reply(w, http.StatusBadRequest, map[string]string{"error": "bad JSON: " + err.Error()})
		return
	}
	if body.Namespace == "" || body.Pod == "" || body.Container == "" || body.Code == nil {
		reply(w, http.StatusBadRequest, map[string]string{"error": "namespace, pod, container and code are required"})
		return
	}
	ofPod := func(c *apitest.FakeContainer) bool {
		return c.Labels[podNamespaceLabel] == body.Namespace && c.Labels[podNameLabel] == body.Pod
	}
	chosen, others := r.exitNewest(body, ofPod)
	if chosen == nil {
		msg := fmt.Sprintf("no running container %q in pod %s/%s; the pod's containers:", body.Container, body.Namespace, body.Pod)
		for _, v := range others {
			msg += fmt.Sprintf(" %s attempt %d %s (exit code %d);", v.Container, v.Attempt, v.State, v.ExitCode)
		}
		if len(others) == 0 {
			msg += " none"
		}
		log.Printf("exit: %s", msg)
		reply(w, http.StatusNotFound, map[string]any{"error": msg, "containers": others})
		return
	}
	log.Printf("exit: %s/%s container %s attempt %d (%s) exited with code %d",
		body.Namespace, body.Pod, body.Container, chosen.Attempt, chosen.ID, *body.Code)
	reply(w, http.StatusOK, map[string]any{"id": chosen.ID, "attempt": chosen.Attempt})
}

// exitNewest makes the running container of the request with the highest attempt (the latest
// created among equals) exit; if there is none it returns the pod's containers instead.
func (r *runtime) exitNewest(body exitRequest, ofPod func(*apitest.FakeContainer) bool) (*containerView, []containerView) {
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	var chosen *apitest.FakeContainer
	for _, c := range rs.Containers {
		if !ofPod(c) || c.Labels[containerNameLabel] != body.Container || c.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
			continue
		}
		if chosen == nil || c.Metadata.GetAttempt() > chosen.Metadata.GetAttempt() ||
			(c.Metadata.GetAttempt() == chosen.Metadata.GetAttempt() && c.CreatedAt > chosen.CreatedAt) {
			chosen = c
		}
	}
	if chosen == nil {
		return nil, r.viewsLocked(ofPod)
	}
	exitLocked(chosen, *body.Code)
	r.killLocked(chosen)
	v := r.view(chosen)
	return &v, nil
}

func reply(w http.ResponseWriter, code int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}
