// Reads a ConfigMap's data (JSON object of strings) on stdin and checks it with MindCluster's own
// device-plugin code: the DeviceInfoCfg value parses into its NodeDeviceInfoCache, its CheckCode
// equals common.MakeDataHash(DeviceInfo), the value re-marshals to the same bytes, and every
// -Fault list parses into []common.DeviceFault and re-marshals to the same bytes. Prints "ok" or
// the first difference (exit 1).
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"

	"Ascend-device-plugin/pkg/common"
)

func fail(format string, args ...interface{}) {
	fmt.Printf(format+"\n", args...)
	os.Exit(1)
}

func main() {
	raw, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail("read: %v", err)
	}
	var data map[string]string
	if err := json.Unmarshal(raw, &data); err != nil {
		fail("data: %v", err)
	}
	text, ok := data["DeviceInfoCfg"]
	if !ok {
		fail("no DeviceInfoCfg")
	}
	var cache common.NodeDeviceInfoCache
	decoder := json.NewDecoder(strings.NewReader(text))
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(&cache); err != nil {
		fail("DeviceInfoCfg: %v", err)
	}
	if want := common.MakeDataHash(cache.DeviceInfo); cache.CheckCode != want {
		fail("CheckCode %s, MindCluster computes %s", cache.CheckCode, want)
	}
	if again := string(common.MarshalData(cache)); again != text {
		fail("DeviceInfoCfg re-marshals differently:\n ours: %s\n Go:   %s", text, again)
	}
	for key, value := range cache.DeviceInfo.DeviceList {
		if !strings.HasSuffix(key, "-Fault") {
			continue
		}
		var faults []common.DeviceFault
		d := json.NewDecoder(strings.NewReader(value))
		d.DisallowUnknownFields()
		if err := d.Decode(&faults); err != nil {
			fail("%s: %v", key, err)
		}
		if again := string(common.MarshalData(faults)); again != value {
			fail("%s re-marshals differently:\n ours: %s\n Go:   %s", key, value, again)
		}
	}
	fmt.Println("ok")
}
